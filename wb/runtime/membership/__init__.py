"""Who takes part in a version, through the rendezvous store: the set-up meeting
(:mod:`~wb.runtime.membership.agree`) and the records it and later changes publish
(:mod:`~wb.runtime.membership.records`); heartbeats and watches
(:mod:`~wb.runtime.membership.liveness`); versions that finish without the workers that died in
them (:mod:`~wb.runtime.membership.finish`); and joining a running job
(:mod:`~wb.runtime.membership.joining`)."""
