"""One hierarchy of errors a person can act on."""

from __future__ import annotations

__all__ = ["WbError", "SpecError", "ProbeError", "PlanError", "TransferError", "PeersLost"]


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
