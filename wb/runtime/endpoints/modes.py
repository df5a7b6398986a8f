"""The four sync modes of :class:`wb.Sender` (trainer) and :class:`wb.Receiver` (rollout).

Two switches give the four sync modes (:data:`MODES`, each a :class:`SyncMode`):

- sender staging off: :meth:`wb.Sender.push` blocks until this trainer's bytes are sent; on: it
  blocks only for a local copy of the weights into a staging buffer, then the copy is sent by a
  background thread while training goes on (the next ``push`` first waits for that send).
- receiver staging off: :meth:`wb.Receiver.apply` receives the new version straight into the live
  buffers, so the rollout stops generating for the whole transfer; on: the version lands in a
  staging buffer in the background while the rollout generates, and ``apply`` is one device copy
  into the live buffers (same addresses, as CUDA graphs need). A rollout never sees half a
  version, and a failed transfer leaves the previous version in place and raises from ``apply``.

Each switch picks, once at set-up, the object that moves a version
(:mod:`wb.runtime.endpoints.sender`, :mod:`wb.runtime.endpoints.receiver`); how a version is
joined and run is :mod:`wb.runtime.endpoints.endpoint`'s, and the seconds each call blocks its
caller are recorded in :mod:`wb.runtime.endpoints.stats`.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["SyncMode", "MODES"]


class SyncMode(NamedTuple):
    """Which sides stage (see the module doc): one of the four sync modes of :data:`MODES`."""

    sender_staging: bool  # push returns after a local copy; a thread sends the copy
    receiver_staging: bool  # versions land in staging while the rollout generates


#: The four sync modes by name.
MODES: dict[str, SyncMode] = {
    "sync": SyncMode(False, False),  # both sides block for the whole transfer
    "sender": SyncMode(True, False),  # trainer copies, trains on; rollouts block while bytes land
    "receiver": SyncMode(False, True),  # trainer blocks; rollouts generate while bytes land
    "both": SyncMode(True, True),  # each side blocks only for one local copy
}
