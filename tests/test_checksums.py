"""A checksum on every message (``wb.runtime.engine.digests``): one bit flipped on the wire in one
message is refused by every rank it reaches (the rank it was sent to, and every rank a forward of
it reaches), and by no other; no rank accepts bytes that differ from the trainers'. Threads over
``LocalTransport`` for every kind of message of a plan whose replicas forward in a ring, then
real processes over UCX through ``wb.Sender`` / ``wb.Receiver``: the version is refused, the
previous one stays live, the next one is applied."""

import json

import numpy as np
import pytest

import wb
from harness.multiproc import buffers_for, coord_child_main, run_ranks
from harness.threads import run_each
from wb.data.plan import RankPlan
from wb.layouts import megatron_trainer, vllm_rollout
from wb.layouts.presets import TINY
from wb.runtime.engine.digests import DIGEST_TAG
from wb.runtime.engine.executor import execute
from wb.runtime.transport.local import LocalHub, LocalTransport


@pytest.fixture(scope="module")
def ring():
    """3 replicas of 2 GPUs that forward to each other in a ring (stage 2), and inside each
    replica (stage 3): messages up to 2 forwards from their trainer."""
    trainers = megatron_trainer(TINY, tp=2, pp=1, ep=2, nodes=["t0"], gpus_per_node=2)
    rollouts = vllm_rollout(TINY, tp=2, ep=2, replicas=3, gpus_per_node=2, first_rank=2)
    p = wb.plan(trainers, rollouts, chunk_bytes=2048)
    assert p.hops.max() >= 2
    return p


class _Flip:
    """A LocalTransport that sends plan message ``m`` with one bit flipped (the sender hashed
    the bytes as they were)."""

    def __init__(self, inner, m: int):
        self.inner, self.m, self.rank, self.checksums = inner, m, inner.rank, inner.checksums

    def send(self, peer, buf, tag):
        if tag == self.m:  # its first byte: the message itself, also where it leads a frame
            buf = buf.copy()
            buf[0] ^= 4
        return self.inner.send(peer, buf, tag)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _reached(plan, m: int) -> set[int]:
    """The ranks message ``m``'s bytes reach: its receiver and the receivers of every forward
    descending from it (the oracle: the plan's parent links, followed one by one)."""
    M, out, todo = plan.messages, set(), [m]
    while todo:
        k = todo.pop()
        out.add(int(M.dst_rank[k]))
        todo += np.flatnonzero(M.parent == k).tolist()
    return out


def _run(plan, flip: int | None, *, checksums: bool = True):
    hub = LocalHub()
    bufs = {r: buffers_for(plan, r, fill=r < len(plan.trainers)) for r in plan.ranks}
    src = int(plan.messages.src_rank[flip]) if flip is not None else -1

    def run(r):
        t = LocalTransport(r, hub, timeout=20, checksums=checksums)
        execute(RankPlan.of(plan, r), bufs[r], _Flip(t, flip) if r == src else t, timeout=20)
    errors = run_each(run, plan.ranks)
    want = {r: buffers_for(plan, r, fill=True) for r in plan.ranks}
    same = {r: all(np.array_equal(bufs[r][k].view(np.uint8), want[r][k].view(np.uint8))
                   for k in bufs[r]) for r in plan.ranks}
    return errors, same


def _messages_of_every_kind(plan):
    """One message per (stage, hops, alone or leading a frame) of the plan, each one that
    travels under its own tag (alone, or first of a frame)."""
    from wb.runtime.engine.program import Program

    M, hops = plan.messages, plan.hops
    out = {}
    for r in plan.ranks:
        units = Program(RankPlan.of(plan, r), checksums=True).units
        for m, g in units.items():
            if g.out and not g.local:
                out.setdefault((int(M.stage[m]), int(hops[m]), hasattr(g, "members")), m)
    return sorted(out.values())


@pytest.mark.timeout(300)
def test_a_flipped_bit_is_refused_by_every_rank_it_reaches_and_no_other(ring):
    kinds = _messages_of_every_kind(ring)
    assert {int(ring.messages.stage[m]) for m in kinds} == {1, 2, 3}
    for m in kinds:
        errors, same = _run(ring, m)
        reached = _reached(ring, m)
        assert set(errors) >= reached, (m, reached, errors)
        for r, e in errors.items():
            assert isinstance(e, wb.ChecksumError), (m, r, e)
            assert e.rank == r and e.bad, e
            if r == int(ring.messages.dst_rank[m]):  # where it landed: that message, its sender
                peer, unit, names, what = e.bad[0]
                assert peer == int(ring.messages.src_rank[m]) and "CRC32C" in what, e
                assert names and all(n in ring.layout_of(r).buffers for n in names)
            else:
                assert "forwarded by rank" in str(e), e
        # nothing accepted that differs from the trainers' weights
        assert all(same[r] for r in ring.ranks if r not in errors), (m, same, errors)
        assert not all(same[r] for r in reached)  # the flip did land somewhere


def test_without_checksums_the_same_flip_goes_unnoticed(ring):
    """What the checks catch: the same fault with them off is served silently."""
    m = int(np.flatnonzero(ring.messages.stage == 1)[0])
    errors, same = _run(ring, m, checksums=False)
    assert not errors and not all(same.values())


def test_a_clean_run_has_one_digest_per_pair_and_hops(ring):
    errors, same = _run(ring, None)
    assert not errors and all(same.values())
    from wb.runtime.engine.program import Program

    prog = Program(RankPlan.of(ring, 4), checksums=True)
    M, hops = ring.messages, ring.hops
    mine = np.flatnonzero((M.dst_rank == 4) & (M.src_rank != 4))
    assert set(prog.routes.inn) == {(int(M.src_rank[k]), int(hops[k])) for k in mine}
    assert max(prog.units) < DIGEST_TAG


def test_peers_that_differ_on_checksums_are_refused_before_any_byte():
    from wb.runtime.engine.executor import connect

    sm = wb.SourceMap.from_indices(np.arange(64))
    p = wb.plan([wb.Layout(wb.Worker(0, "a", "trainer"), {"w": wb.BufferSpec(sm, "float32")})],
                [wb.Layout(wb.Worker(1, "b", "rollout"), {"w": wb.BufferSpec(sm, "float32")})])
    hub = LocalHub()
    ts = {0: LocalTransport(0, hub, timeout=20), 1: LocalTransport(1, hub, checksums=False)}
    errors = run_each(lambda r: connect(RankPlan.of(p, r), ts[r]), [0, 1])
    assert set(errors) == {0, 1} and all("take checksums otherwise" in str(e)
                                         for e in errors.values()), errors


# --- real processes -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ring_file(ring, tmp_path_factory):
    d = tmp_path_factory.mktemp("ring")
    ring.save(d / "plan.npz")
    return d / "plan.npz"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("staging", [True, False])
def test_over_ucx_the_version_is_refused_and_the_next_applied(ring, ring_file, tmp_path, staging):
    stamp = tmp_path / "flipped.json"
    run = run_ranks(str(ring_file), ring.ranks, str(tmp_path), target=coord_child_main,
                    options={"versions": 3, "timeout": 30, "receiver_staging": staging},
                    faults={0: {"flip_in": 2, "flip_send": 0, "stamp": str(stamp)}},
                    join_timeout=200)
    flipped = json.loads(stamp.read_text())
    reached = _reached(ring, flipped["message"])
    for r in ring.ranks:
        res = run.results[r]
        assert res is not None and res["ok"], (r, res)
        if r < len(ring.trainers):
            continue
        assert all(res["checks"]), res  # what was applied is the trainers' weights
        if r in reached:
            assert res["applied"] == [1, 3], res
            (refused,) = res["refused"]
            if r == flipped["peer"]:
                assert [0, flipped["message"]] in [b[:2] for b in refused["bad"]], refused
            if staging:  # the live buffers kept version 1
                assert refused["version"] == 1 and refused["intact"], refused
                assert "still hold version 1" in refused["error"]
            else:
                assert refused["version"] == -1 and "hold what failed" in refused["error"]
        else:
            assert res["applied"] == [1, 2, 3] and "refused" not in res, res


def test_receives_are_copied_hashed_only_where_a_device_s_transport_can(monkeypatch):
    """The engine hands its receives to the transport's copy-and-hash (``hashed=``) only where
    the CRCs are a device's, the transport says it can, the update sends no deltas and
    ``WB_COPY_HASHED`` asks for it (``1`` or ``stretch:threads``; unset or ``0``: not); the
    hasher's rows are ``(source, bytes, slot, destination)`` in the unit's slot, and
    ``WB_COPY_HASHED=stretch:threads`` shapes its kernel."""
    from wb.runtime.engine import digests as dg

    rows = []

    class Sums(dg._DeviceSums):  # a device's CRCs, without a device
        def __init__(self):
            pass

        def copy_hashed(self, r, stream):
            rows.append((r, stream))

    digests = type("D", (), {"sums": Sums(), "r": type("R", (), {"slot": {7: 3}})()})()
    can = type("T", (), {"copies_hashed": True})()
    cannot = type("T", (), {"copies_hashed": False})()
    host = type("D", (), {"sums": dg._HostSums(1), "r": digests.r})()
    monkeypatch.delenv("WB_COPY_HASHED", raising=False)
    assert dg.copies_hashed(can, digests, None) is None  # opt-in
    monkeypatch.setenv("WB_COPY_HASHED", "1")
    hasher = dg.copies_hashed(can, digests, None)
    assert isinstance(hasher, dg.CopyHashed)
    for args in ((cannot, digests, None), (object(), digests, None), (can, host, None),
                 (can, None, None), (can, digests, object())):
        assert dg.copies_hashed(*args) is None
    g = type("G", (), {"m": 7})()
    hasher.copy_many([(g, 1000, 2000, 64)], "stream")
    assert rows == [([(2000, 64, 3, 1000)], "stream")]
    assert dg._copier_shape() == {"sub": dg.COPY_SHAPE[0], "threads": dg.COPY_SHAPE[1]}
    monkeypatch.setenv("WB_COPY_HASHED", "0")
    assert dg.copies_hashed(can, digests, None) is None
    monkeypatch.setenv("WB_COPY_HASHED", "256:128")
    assert dg.copies_hashed(can, digests, None) is not None
    assert dg._copier_shape() == {"sub": 256, "threads": 128}
    for bad in ("1024:", "256:100", "0:256", "a:b"):
        monkeypatch.setenv("WB_COPY_HASHED", bad)
        with pytest.raises(wb.TransferError, match="WB_COPY_HASHED"):
            dg._copier_shape()


class _HostDeviceSums:
    """A device's CRCs (``digests._DeviceSums``' interface) kept on the host: each taken at once
    and XORed into its slot as the kernel does, so a unit hashed twice cancels out."""

    def __init__(self, n: int):
        from wb.runtime.engine import crc

        self.crc, self.values = crc, np.zeros(max(n, 1), np.uint32)

    def take(self, buf, slot):
        self.values[slot] ^= self.crc.host(np.ascontiguousarray(buf))

    def copy_hashed(self, rows, stream):
        import ctypes

        for src, n, slot, dst in rows:
            ctypes.memmove(dst, src, n)
            self.values[slot] ^= self.crc.host(np.ctypeslib.as_array(
                (ctypes.c_uint8 * n).from_address(dst)))

    def flush(self, *, idle=True):
        pass

    def fetch(self):
        return None

    def guard(self):
        return None

    def passed(self, token):
        return True

    def read(self, slots):
        return self.values[slots].tolist()


class _Hashing:
    """A LocalTransport whose receives take ``hashed=(hasher, key)``: the message lands in a
    scratch buffer, then the hasher copies it into the receive's buffer and hashes it (as the
    one-sided channel hands a CUDA receive's copy to the copy-and-CRC kernel)."""

    copies_hashed = True

    def __init__(self, inner):
        self.inner, self.rank, self.checksums, self.count = inner, inner.rank, inner.checksums, 0

    def recv(self, peer, buf, tag, *, upto=False, hashed=None):
        if hashed is None:
            return self.inner.recv(peer, buf, tag, upto=upto)
        scratch = np.empty(buf.nbytes, np.uint8)
        return _HashedRecv(self, self.inner.recv(peer, scratch, tag), hashed, buf, scratch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _HashedRecv:
    def __init__(self, t, req, hook, buf, scratch):
        self.t, self.req, self.hook, self.buf, self.scratch = t, req, hook, buf, scratch
        self.hashed = False

    def done(self):
        if not self.req.done():
            return False
        if not self.hashed:
            hasher, key = self.hook
            hasher.copy_many([(key, self.buf.ctypes.data, self.scratch.ctypes.data,
                               self.scratch.nbytes)], None)
            self.hashed = True
            self.t.count += 1
        return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flip", [False, True])
def test_receives_copied_hashed_by_the_transport_are_checked_once(ring, monkeypatch, flip):
    """The update's receives (zero-copy and staged) go to a transport that copies and hashes
    them (``WB_COPY_HASHED=1``, a device's CRCs stood in for on the host): every rollout
    bit-identical and every digest matched (a unit hashed twice would cancel its CRC out and
    fail), or, with one bit flipped, refused by every rank it reaches and no other."""
    from wb.runtime.engine import digests as dg

    monkeypatch.setenv("WB_COPY_HASHED", "1")
    monkeypatch.setattr(dg.Routes, "sums", lambda self, xp: _HostDeviceSums(len(self.slot)))
    monkeypatch.setattr(dg, "_DeviceSums", _HostDeviceSums)
    m = _messages_of_every_kind(ring)[-1] if flip else None
    hub = LocalHub()
    bufs = {r: buffers_for(ring, r, fill=r < len(ring.trainers)) for r in ring.ranks}
    src = int(ring.messages.src_rank[m]) if flip else -1
    transports = {}

    def run(r):
        t = transports[r] = _Hashing(LocalTransport(r, hub, timeout=20, checksums=True))
        execute(RankPlan.of(ring, r), bufs[r], _Flip(t, m) if r == src else t, timeout=20)
    errors = run_each(run, ring.ranks)
    want = {r: buffers_for(ring, r, fill=True) for r in ring.ranks}
    assert sum(t.count for t in transports.values()) > 0
    reached = _reached(ring, m) if flip else set()
    assert set(errors) == reached, errors
    assert all(isinstance(e, wb.ChecksumError) for e in errors.values()), errors
    for r in set(ring.ranks) - reached:
        assert all(np.array_equal(bufs[r][k].view(np.uint8), want[r][k].view(np.uint8))
                   for k in bufs[r]), r
