"""The endpoints users hold: :class:`~wb.runtime.endpoints.sender.Sender` and
:class:`~wb.runtime.endpoints.receiver.Receiver` over what they share
(:mod:`~wb.runtime.endpoints.endpoint`), the buffers a version arrives in
(:mod:`~wb.runtime.endpoints.targets`), the groups of a process's ranks
(:mod:`~wb.runtime.endpoints.group`), an in-process session (:mod:`~wb.runtime.endpoints.session`),
the sync modes (:mod:`~wb.runtime.endpoints.modes`) and the records behind EWTT and AGST
(:mod:`~wb.runtime.endpoints.stats`)."""
