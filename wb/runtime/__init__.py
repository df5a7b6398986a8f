"""The runtime: transports (:mod:`~wb.runtime.transport`) and rendezvous stores
(:mod:`~wb.runtime.rendezvous`); a rank's part of a plan (:mod:`~wb.runtime.program`), one update of
it (:mod:`~wb.runtime.update`) and the one-shot entry points (:mod:`~wb.runtime.executor`); the
Sender and Receiver that coordinate versions and sync modes (:mod:`~wb.runtime.coordinator`, built
from :mod:`~wb.runtime.sender`, :mod:`~wb.runtime.receiver` and :mod:`~wb.runtime.endpoint`)."""
