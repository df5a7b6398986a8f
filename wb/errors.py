"""One hierarchy of errors a person can act on."""

from __future__ import annotations

__all__ = ["WbError", "SpecError", "ProbeError", "PlanError", "TransferError", "PeersLost",
           "ChecksumError", "AuthError", "WbWarning"]


class WbError(Exception):
    """Base class of every error raised by WeightBridge."""


class SpecError(WbError, ValueError):
    """A checkpoint spec, source map or layout argument is malformed."""


class ProbeError(WbError):
    """A load function is not pure data movement, raised, or returned something unusable."""


class PlanError(WbError):
    """Layouts cannot be served (an id needed and held by nobody) or a plan is inconsistent."""


class TransferError(WbError):
    """A transfer failed: a peer died or hung, or the buffers do not match the plan."""


class PeersLost(TransferError):
    """An update stopped because peers stopped beating while it waited for them, or (``ranks``
    empty) because the version went on without this worker's attempt; the transport is kept (the
    requests in flight are cancelled, not the connections), so the version can finish without
    the lost peers.

    Args:
        message: what happened, naming the peers.
        ranks: ``{rank: seconds silent}`` of the peers that stopped beating.
    """

    def __init__(self, message: str, ranks: dict[int, float]):
        super().__init__(message)
        self.ranks = ranks

    def __reduce__(self):  # picklable, as exceptions crossing processes must be
        return type(self), (str(self), self.ranks)


class AuthError(TransferError):
    """A value or peer without the job's key (:mod:`wb.runtime.transport.keyed`): refused."""


class WbWarning(UserWarning):
    """Something a user should know that does not stop the job (e.g. no job key)."""


class ChecksumError(TransferError):
    """Messages of an update failed their checksums (or came from a forwarder whose input did).
    Raised once every byte of the update moved: the transport is intact and the peers went on.

    Attributes:
        rank: the worker that found it.
        bad: ``[(peer, message, buffers, what)]``: per failed unit its sender, its plan message
            (a frame: its first), the buffers it writes, and what failed.
        stats: the update's :class:`~wb.runtime.engine.update.ExecStats` (its bytes did move).
        note: what it means for the caller (a :class:`wb.Receiver`: what the live buffers hold).
    """

    def __init__(self, rank: int, bad: list[tuple[int, int, list[str], str]], stats=None, *,
                 note: str = ""):
        self.rank, self.bad, self.stats, self.note = rank, bad, stats, note
        shown = "; ".join(f"message {m} from rank {p} into {', '.join(b[:3])}"
                          f"{' ...' if len(b) > 3 else ''}: {what}" for p, m, b, what in bad[:4])
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        super().__init__(f"rank {rank}: {len(bad)} message{'s' if len(bad) != 1 else ''} failed "
                         f"their checksums, nothing of this version is trusted: {shown}{more}"
                         f"{'; ' + note if note else ''}")

    def __reduce__(self):
        return _rebuilt, (self.rank, self.bad, self.stats, self.note)


def _rebuilt(rank, bad, stats, note):
    return ChecksumError(rank, bad, stats, note=note)
