"""Sender / Receiver / LocalSession: every sync mode delivers every version bit-exactly; receiver
staging never exposes half a version; a failed update leaves the previous one and raises."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import pytest

import wb
from wb.runtime.transport.stores import MemoryStore
from wb.runtime.transport.local import LocalHub, LocalTransport
from wb.runtime.endpoints.stats import UpdateStats


def _case():
    """2 trainers (column halves) -> 2 rollout nodes x 2 workers (row halves), 2 tensors."""
    spec = wb.CheckpointSpec({"a": ((8, 12), "bfloat16"), "b": ((6, 4), "float32")})
    trainers, rollouts = [], []
    for r in range(2):
        bufs = {}
        for n in spec.names:
            ids = spec.offset(n) + np.arange(int(np.prod(spec.shape(n)))).reshape(spec.shape(n))
            cols = ids.shape[1] // 2
            bufs[n] = wb.BufferSpec(wb.SourceMap.from_indices(ids[:, r * cols:(r + 1) * cols]),
                                    spec.dtype(n))
        trainers.append(wb.Layout(wb.Worker(r, "t0", "trainer", r), bufs))
    for node in range(2):
        for local in range(2):
            bufs = {}
            for n in spec.names:
                ids = spec.offset(n) + np.arange(int(np.prod(spec.shape(n)))).reshape(spec.shape(n))
                rows = ids.shape[0] // 2
                bufs[n] = wb.BufferSpec(
                    wb.SourceMap.from_indices(ids[local * rows:(local + 1) * rows]), spec.dtype(n))
            rollouts.append(wb.Layout(wb.Worker(2 + 2 * node + local, f"r{node}", "rollout",
                                                local), bufs))
    return wb.plan(trainers, rollouts, chunk_bytes=16)  # many small messages


def _values(lay, version):
    """Version ``version`` of the weights in this layout: a function of (id, version)."""
    return {n: _bits(b.sourcemap.to_indices(), version, b.dtype) for n, b in lay.buffers.items()}


def _bits(ids, version, dtype):
    vals = ((ids * 7 + version * 1009) % 4093).astype(np.float32) / 8 - 200
    return vals.astype(wb.data.dtypes.dtype_info(dtype).numpy)


def _same(bufs, lay, version) -> bool:
    want = _values(lay, version)
    return all(np.array_equal(bufs[n].view(np.uint8), want[n].view(np.uint8)) for n in want)


def _set(bufs, lay, version):
    for n, v in _values(lay, version).items():
        bufs[n][...] = v


@pytest.mark.parametrize("mode", sorted(wb.MODES))
def test_every_mode_delivers_every_version(mode):
    p = _case()
    tb = {lay.worker.rank: _values(lay, 0) for lay in p.trainers}
    rb = {lay.worker.rank: {n: np.zeros_like(a) for n, a in _values(lay, 0).items()}
          for lay in p.rollouts}
    with wb.LocalSession(p, tb, rb, mode=mode, timeout=20) as s:
        for v in (1, 2, 3):
            for lay in p.trainers:  # a training step changes the weights
                _set(tb[lay.worker.rank], lay, v)
            summary = s.update()
            assert summary.versions == 1 and summary.ewtt_s >= 0
            for lay in p.rollouts:
                assert _same(rb[lay.worker.rank], lay, v), (mode, v, lay.worker.rank)
            assert all(r.version == v for r in s.receivers.values())
        with pytest.raises(wb.TransferError, match="versions must increase"):
            s.senders[0].push(version=3)
        stats = s.stats()
    assert len(stats) == 3 * (len(p.trainers) + len(p.rollouts))
    assert {x.version for x in stats} == {1, 2, 3}
    # every byte a rollout received is counted once
    assert sum(x.bytes_received for x in stats if x.role == "rollout") > 0


class _GatedTransport:
    """A local transport whose sends after the first ``free`` wait until ``gate`` is set."""

    def __init__(self, inner, gate: threading.Event, free: int):
        self.inner, self.gate, self.free, self.rank = inner, gate, free, inner.rank
        self.sent = 0

    def connect(self, peers, *, hello=b""):
        return self.inner.connect(peers, hello=hello)

    def send(self, peer, buf, tag):
        self.sent += 1
        if self.sent <= self.free or self.gate.is_set():
            return self.inner.send(peer, buf, tag)
        return _Held(self, peer, buf, tag)

    def recv(self, peer, buf, tag):
        return self.inner.recv(peer, buf, tag)

    def describe(self):
        return "gated"

    def close(self, **kw):
        self.inner.close(**kw)

    def abort(self):
        self.inner.abort()


class _Held:
    def __init__(self, t, peer, buf, tag):
        self.t, self.peer, self.buf, self.tag, self.req = t, peer, buf, tag, None

    def done(self):
        if self.req is None:
            if not self.t.gate.is_set():
                return False
            self.req = self.t.inner.send(self.peer, self.buf, self.tag)
        return self.req.done()


def _make_all(*makers):
    """Workers connect to their peers when made (a set-up round): make them concurrently."""
    with ThreadPoolExecutor(len(makers)) as pool:
        return [f.result() for f in [pool.submit(m) for m in makers]]


def _senders_receivers(p, *, gate, free, timeout=20, send_staging=True, recv_staging=True):
    hub, store = LocalHub(), MemoryStore()
    tb = {lay.worker.rank: _values(lay, 1) for lay in p.trainers}
    rb = {lay.worker.rank: _values(lay, 0) for lay in p.rollouts}  # live: version 0
    made = _make_all(
        *[partial(wb.Sender, p, r, tb[r], staging=send_staging, store=store, timeout=timeout,
                  transport=_GatedTransport(LocalTransport(r, hub, timeout=timeout), gate, free))
          for r in tb],
        *[partial(wb.Receiver, p, r, rb[r], staging=recv_staging, store=store, timeout=timeout,
                  wait_timeout=timeout, transport=LocalTransport(r, hub, timeout=timeout))
          for r in rb])
    return tb, rb, made[:len(tb)], made[len(tb):]


def test_receiver_staging_never_exposes_half_a_version():
    p = _case()
    gate = threading.Event()
    tb, rb, senders, receivers = _senders_receivers(p, gate=gate, free=3)
    lays = {lay.worker.rank: lay for lay in p.rollouts}
    seen, bad, stop = [], [], threading.Event()

    def generate():  # the rollout loop: generate (read the weights), apply between steps
        while not stop.is_set():
            for rx in receivers:
                v = rx.version
                if not _same(rb[rx.rank], lays[rx.rank], v):
                    bad.append((rx.rank, v))
                seen.append(v)
                if rx.ready():
                    rx.apply()
            if all(rx.version == 1 for rx in receivers):
                return

    reader = threading.Thread(target=generate)
    reader.start()
    for s in senders:
        s.push()  # version 1, in the background (sender staging)
    # some bytes of version 1 have landed in staging, the rest is held back
    deadline = time.monotonic() + 10
    while not any(any(a.view(np.uint8).any() for a in rx._path.staging.values())
                  for rx in receivers):
        assert time.monotonic() < deadline, "no bytes landed"
        time.sleep(0.01)
    time.sleep(0.2)
    assert not any(rx.ready() for rx in receivers)
    for rx in receivers:
        assert rx.version == 0
        assert _same(rb[rx.rank], lays[rx.rank], 0)  # live buffers untouched mid-transfer
    gate.set()
    reader.join(20)
    stop.set()
    for s in senders:
        s.wait()
    assert not bad, bad[:5]
    assert 0 in seen and all(_same(rb[rx.rank], lays[rx.rank], 1) for rx in receivers)
    for w in (*senders, *receivers):
        w.close()


def test_failed_update_keeps_previous_version_and_raises_on_apply():
    p = _case()
    gate = threading.Event()  # never set: the trainer "dies" after a few sends
    tb, rb, senders, receivers = _senders_receivers(p, gate=gate, free=2, timeout=1.0)
    lays = {lay.worker.rank: lay for lay in p.rollouts}
    for s in senders:
        s.push()
    errors = 0
    for rx in receivers:
        t0 = time.monotonic()
        with pytest.raises(wb.TransferError, match="still hold version 0"):
            rx.apply()
        assert time.monotonic() - t0 < 15
        assert _same(rb[rx.rank], lays[rx.rank], 0)
        assert rx.version == 0 and rx.ready()  # ready: apply has something to say
        with pytest.raises(wb.TransferError):
            rx.apply()  # and keeps saying it
        errors += 1
    assert errors == len(receivers)
    for s in senders:
        with pytest.raises(wb.TransferError, match="sending version 1 failed"):
            s.wait()


def test_bad_input_is_refused_at_setup():
    p = _case()
    store, hub = MemoryStore(), LocalHub()
    lay = p.trainers[0]
    good = _values(lay, 0)
    with pytest.raises(wb.TransferError, match="not a rollout"):
        wb.Receiver(p, lay.worker.rank, good, store=store, transport=LocalTransport(0, hub))
    wrong = dict(good, a=np.zeros((3, 3), good["a"].dtype))
    with pytest.raises(wb.TransferError, match="shape"):
        wb.Sender(p, lay.worker.rank, wrong, store=store, transport=LocalTransport(0, hub))
    with pytest.raises(wb.TransferError, match="mode must be one of"):
        wb.LocalSession(p, {}, {}, mode="fast")


def test_summary_is_computed_from_records():
    recs = [UpdateStats(1, 0, "trainer", 0.2, 0.0, 1.0, 3.0, 10, 0),
            UpdateStats(1, 1, "rollout", 0.4, 0.0, 2.0, 3.5, 0, 10),
            UpdateStats(2, 0, "trainer", 0.0, 5.0, 6.0, 7.0, 10, 0),
            UpdateStats(2, 1, "rollout", 0.2, 5.0, 6.0, 6.5, 0, 10)]
    s = wb.summarize(recs)
    assert s.ewtt_per_version == {1: 1.5, 2: 1.0}
    assert s.ewtt_s == pytest.approx(1.25)
    assert s.agst_s == pytest.approx((0.3 + 0.1) / 2)
    assert s.trainer_stall_s == pytest.approx(0.1) and s.rollout_stall_s == pytest.approx(0.3)
    assert UpdateStats.from_json(recs[0].to_json()) == recs[0]


def test_sync_receiver_is_ready_once_every_trainer_announced_each_version():
    p = _case()
    gate = threading.Event()
    gate.set()
    tb, rb, senders, receivers = _senders_receivers(p, gate=gate, free=0, recv_staging=False)
    for v in (1, 2):
        assert not any(rx.ready() for rx in receivers)  # version v not announced yet
        senders[0].push()
        assert not any(rx.ready() for rx in receivers)  # trainer 1 has not pushed it yet
        senders[1].push()
        assert all(rx.ready() for rx in receivers)
        threads = [threading.Thread(target=rx.apply) for rx in receivers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        for s in senders:
            s.wait()
        assert all(rx.version == v for rx in receivers)


# --- set-up through the store, per rank: agree_parts ----------------------------------------------
def _agree_in_threads(p, store, **kw):
    """Every worker of ``p`` as its own "process" (a thread) calling agree_parts."""
    from wb.runtime.membership.agree import agree_parts
    lays = [*p.trainers, *p.rollouts]
    planned, out = [], {}

    def one(lay):
        out[lay.worker.rank] = agree_parts(store, [lay], world=len(lays), timeout=30,
                                           planned=planned, chunk_bytes=p.chunk_bytes, **kw)
    with ThreadPoolExecutor(len(lays)) as pool:
        for f in [pool.submit(one, lay) for lay in lays]:
            f.result(timeout=60)
    return planned, out


@pytest.mark.parametrize("store_kind", ["memory", "directory"])
def test_agree_parts_gives_each_rank_only_its_part(store_kind, tmp_path):
    from wb.data.plan import RankPlan
    from wb.runtime.transport.stores import CountingStore, DirectoryStore
    p = _case()
    inner = MemoryStore() if store_kind == "memory" else DirectoryStore(tmp_path)
    store = CountingStore(inner)
    store.max_value_bytes = 700  # every value goes as several chunks
    planned, out = _agree_in_threads(p, store)
    (whole,) = planned
    assert whole == p
    for r, got in out.items():
        assert list(got) == [r]
        assert got[r] == RankPlan.of(p, r)
        assert got[r].layout == p.layout_of(r)


def test_a_session_runs_from_the_parts_agree_parts_gives():
    p = _case()
    _, out = _agree_in_threads(p, MemoryStore())
    everyone = {r: q for got in out.values() for r, q in got.items()}
    tb = {lay.worker.rank: _values(lay, 0) for lay in p.trainers}
    rb = {lay.worker.rank: {n: np.zeros_like(a) for n, a in _values(lay, 0).items()}
          for lay in p.rollouts}
    with wb.LocalSession(everyone, tb, rb, mode="both", timeout=20) as s:
        for v in (1, 2):
            for lay in p.trainers:
                _set(tb[lay.worker.rank], lay, v)
            s.update()
            for lay in p.rollouts:
                assert _same(rb[lay.worker.rank], lay, v)
    with pytest.raises(wb.TransferError, match="not a trainer"):
        wb.Sender(everyone, 2, tb[0], transport=None, store=MemoryStore())
