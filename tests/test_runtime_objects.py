"""The runtime as objects: each Sender/Receiver owns its program (no cache behind anyone's back),
each sync mode is the choice of two small strategies made once at set-up, and background results
come back as Futures."""

import importlib
import pkgutil
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

import wb
import wb.runtime
from wb.runtime.endpoints.modes import SyncMode
from wb.runtime.transport.stores import MemoryStore
from wb.runtime.transport.local import LocalHub, LocalTransport


def _plan():
    """1 trainer -> 2 rollouts (one node), every rollout needs the whole tensor."""
    sm = wb.SourceMap.from_indices(np.arange(24).reshape(4, 6))
    lay = lambda r, role, node: wb.Layout(wb.Worker(r, node, role, r),  # noqa: E731
                                          {"w": wb.BufferSpec(sm, "float32")})
    return wb.plan([lay(0, "trainer", "t")], [lay(1, "rollout", "r"), lay(2, "rollout", "r")])


def _weights(v):
    return (np.arange(24, dtype=np.float32).reshape(4, 6) + 100 * v)


@pytest.mark.parametrize("mode", sorted(wb.MODES))
def test_each_mode_is_two_strategies_chosen_at_setup(mode):
    sync = wb.MODES[mode]
    assert sync == (sync.sender_staging, sync.receiver_staging) and isinstance(sync, SyncMode)
    p = _plan()
    rb = {r: {"w": np.zeros((4, 6), np.float32)} for r in (1, 2)}
    with wb.LocalSession(p, {0: {"w": _weights(1)}}, rb, mode=mode, timeout=20) as s:
        send = {type(x._path).__name__ for x in s.senders.values()}
        recv = {type(x._path).__name__ for x in s.receivers.values()}
        assert send == {"_StagedSend" if sync.sender_staging else "_DirectSend"}
        assert recv == {"_BackgroundReceive" if sync.receiver_staging else "_DirectReceive"}
        assert {type(x._target).__name__ for x in s.receivers.values()} == {"InPlace"}
        s.update()
        assert all((b["w"] == _weights(1)).all() for b in rb.values())


def _make_all(*makers):
    with ThreadPoolExecutor(len(makers)) as pool:
        return [f.result() for f in [pool.submit(m) for m in makers]]


@pytest.mark.parametrize("staging", [True, False])
def test_handoff_hands_over_new_buffers_every_version_and_the_old_ones_stay(staging):
    p = _plan()
    hub, store = LocalHub(), MemoryStore()
    live = {"w": _weights(1)}
    tx, *rxs = _make_all(
        lambda: wb.Sender(p, 0, live, transport=LocalTransport(0, hub), store=store,
                          staging=staging),
        *[lambda r=r: wb.Receiver(p, r, None, transport=LocalTransport(r, hub), store=store,
                                  staging=staging, handoff=True, timeout=20) for r in (1, 2)])
    assert {type(rx._target).__name__ for rx in rxs} == {"Handoff"}
    first = [rx.buffers["w"] for rx in rxs]
    assert all((a == 0).all() for a in first)  # no version yet: zeros
    seen = []
    with tx, rxs[0], rxs[1]:
        for v in (1, 2):
            live["w"][...] = _weights(v)
            with ThreadPoolExecutor(3) as pool:
                futs = [pool.submit(tx.push)] + [pool.submit(rx.apply) for rx in rxs]
                assert [f.result(timeout=30) for f in futs] == [v] * 3
            tx.wait()
            now = [rx.buffers["w"] for rx in rxs]
            assert all((a == _weights(v)).all() for a in now)
            seen.append(now)
    # every version landed in new buffers; the ones handed over before were never written again
    assert all(a is not b for a, b in zip(seen[0], seen[1]))
    assert all((a == _weights(1)).all() for a in seen[0])


def test_every_worker_owns_its_program_and_no_module_caches_programs():
    """Two sessions of one plan: their senders of rank 0 run separate programs, and no module of
    the runtime keeps programs (or anything else mutable) behind the caller's back."""
    p = _plan()
    rb = lambda: {r: {"w": np.zeros((4, 6), np.float32)} for r in (1, 2)}  # noqa: E731
    with wb.LocalSession(p, {0: {"w": _weights(1)}}, rb(), timeout=20) as a, \
            wb.LocalSession(p, {0: {"w": _weights(1)}}, rb(), timeout=20) as b:
        pa, pb = a.senders[0]._end.program, b.senders[0]._end.program
        assert isinstance(pa, wb.runtime.engine.program.Program) and pa is not pb
        assert pa.messages.keys() == pb.messages.keys()
    allowed = {"MODES"}  # a constant table
    for info in pkgutil.walk_packages(wb.runtime.__path__, "wb.runtime."):
        mod = importlib.import_module(info.name)
        for name, value in vars(mod).items():
            if name.startswith("__") or name in allowed:
                continue
            assert not isinstance(value, (dict, list, set)), f"{info.name}.{name} is module state"


class _Counted(LocalTransport):
    closes = 0

    def close(self, **kw):
        self.closes += 1
        super().close(**kw)


def test_a_staged_send_is_a_future_and_the_workers_close_on_exit():
    p = _plan()
    hub, store = LocalHub(), MemoryStore()
    transports = {r: _Counted(r, hub) for r in (0, 1, 2)}
    tx, *rxs = _make_all(
        lambda: wb.Sender(p, 0, {"w": _weights(1)}, transport=transports[0], store=store),
        *[lambda r=r: wb.Receiver(p, r, {"w": np.zeros((4, 6), np.float32)}, store=store,
                                  transport=transports[r], timeout=20) for r in (1, 2)])
    with tx:
        assert tx.push() == 1
        assert isinstance(tx._path.pending.result, Future)
        for rx in rxs:
            with rx:
                assert rx.apply() == 1 and (rx.buffers["w"] == _weights(1)).all()
            with pytest.raises(wb.TransferError, match="apply\\(\\) after close\\(\\)"):
                rx.apply()
    with pytest.raises(wb.TransferError, match="push\\(\\) after close\\(\\)"):
        tx.push()
    assert [t.closes for t in transports.values()] == [1, 1, 1]
    assert [s.version for s in tx.stats] == [1]


@pytest.mark.parametrize("mode", sorted(wb.MODES))
def test_closed_workers_free_their_staging_without_the_garbage_collector(mode):
    """A closed and dropped Sender/Receiver releases its buffers at once: on a GPU shared by many
    processes, staging kept alive until a garbage-collector pass (a cycle through a cancelled
    receive's traceback did that) runs the next mode out of memory."""
    import gc
    import tracemalloc

    sm = wb.SourceMap.from_indices(np.arange(1 << 18))
    lay = lambda r, role: wb.Layout(wb.Worker(r, role[0], role, 0),  # noqa: E731
                                    {"w": wb.BufferSpec(sm, "float32")})
    plan = wb.plan([lay(0, "trainer")], [lay(1, "rollout")], chunk_bytes=1 << 16)
    src, dst = np.ones(1 << 18, np.float32), np.zeros(1 << 18, np.float32)
    gc.collect()
    gc.disable()
    try:
        tracemalloc.start()
        s = wb.LocalSession(plan, {0: {"w": src}}, {1: {"w": dst}}, mode=mode, timeout=20)
        s.update()
        s.close()
        del s
        left = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        gc.enable()
    assert (dst == src).all()
    assert left < src.nbytes // 4, f"{left:,} bytes still held after close (a staging copy is " \
                                    f"{src.nbytes:,})"


def _padded_plan():
    """1 trainer -> 1 rollout whose buffer has a padding row (-1: no checkpoint id)."""
    ids = np.full((5, 6), -1, np.int64)
    ids[:4] = np.arange(24).reshape(4, 6)
    trainer = wb.Layout(wb.Worker(0, "t", "trainer", 0), {"w": wb.BufferSpec(
        wb.SourceMap.from_indices(np.arange(24).reshape(4, 6)), "float32")})
    rollout = wb.Layout(wb.Worker(1, "r", "rollout", 0), {"w": wb.BufferSpec(
        wb.SourceMap.from_indices(ids), "float32")})
    return wb.plan([trainer], [rollout])


@pytest.mark.parametrize("staging", [True, False])
def test_recycled_receives_reuse_a_set_once_its_arrays_are_freed_and_never_write_held_ones(
        staging):
    """``recycle=True``: versions land in wb's own buffers, handed over as DLPack exports that
    the consumer makes arrays of without a copy (np.from_dlpack here; jax.dlpack.from_dlpack on a
    GPU). A set is written again only once every array made of it is gone; arrays the caller
    keeps are never written, whatever comes after; padding keeps the template's values."""
    from wb.runtime.engine.buffers import address

    p = _padded_plan()
    hub, store = LocalHub(), MemoryStore()
    live = {"w": _weights(1)}
    template = np.full((5, 6), -7.0, np.float32)  # its padding row must survive every version
    tx, rx = _make_all(
        lambda: wb.Sender(p, 0, live, transport=LocalTransport(0, hub), store=store,
                          staging=staging),
        lambda: wb.Receiver(p, 1, {"w": template}, transport=LocalTransport(1, hub),
                            store=store, staging=staging, handoff=True, recycle=True,
                            timeout=20))
    assert type(rx._target).__name__ == "Recycled"

    def update(v):
        live["w"][...] = _weights(v)
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(tx.push), pool.submit(rx.apply)]
            assert [f.result(timeout=30) for f in futs] == [v, v]
        tx.wait()
        (exp,) = rx.buffers.values()
        assert isinstance(exp, wb.runtime.engine.dlpack.Export)
        got = np.from_dlpack(exp)
        assert address(got) == address(exp)  # the consumer's array is wb's memory: no copy
        assert (got[:4] == _weights(v)).all() and (got[4] == -7.0).all()
        return got

    def sets():
        return [address(s.arrays["w"]) for s in rx._target.sets]

    with tx, rx:
        a1 = update(1)
        a2 = update(2)
        assert address(a1) != address(a2) and len(sets()) == 2
        where1 = address(a1)
        del a1  # version 1's array freed: its set may be written again
        a3 = update(3)
        assert address(a3) == where1 and len(sets()) == 2  # reused, not a new set
        kept = a2  # the caller keeps version 2's array...
        del a2, a3
        a4 = update(4)
        a5 = update(5)
        # ... so its set was never written again: versions 4 and 5 went elsewhere
        assert address(kept) not in {address(a4), address(a5)}
        assert (kept[:4] == _weights(2)).all() and (kept[4] == -7.0).all()
        assert len(sets()) == 3
    assert (template == -7.0).all()  # the template itself was never written
