"""A job key (``wb.runtime.transport.keyed``): every store value signed (HMAC-SHA256 over its key's
name and bytes) and refused without the same key; a key from ``WB_JOB_KEY``; values of any size
through ``set_large`` under a store's value limit; and, in real processes over UCX, a process
with another key is refused: its join request is not taken, the job goes on."""

import warnings

import numpy as np
import pytest

import wb
from wb.runtime.transport.keyed import KeyedStore, job_key, keyed
from wb.runtime.transport.stores import (DirectoryStore, MemoryStore, get_large, get_record,
                                         set_large, set_record)

KEY, OTHER = "k" * 16 + "-job", "o" * 16 + "-other"


def test_a_signed_value_reads_back_and_nothing_else_does(tmp_path):
    raw = DirectoryStore(tmp_path)
    s = KeyedStore(raw, KEY)
    s.set("a/b", b"payload")
    assert s.get("a/b", 1) == b"payload"
    assert raw.get("a/b", 1) != b"payload"  # what lies in the store is signed
    raw.set("c", b"from a stranger")  # not signed
    KeyedStore(raw, OTHER).set("d", b"signed with another key")
    raw.set("e", raw.get("a/b", 1))  # a signed value under another name
    tampered = bytearray(raw.get("a/b", 1))
    tampered[-1] ^= 1
    raw.set("f", bytes(tampered))
    for k, what in (("c", "is not signed"), ("d", "another key"), ("e", "another key"),
                    ("f", "another key")):
        with pytest.warns(wb.errors.WbWarning), pytest.raises(wb.AuthError, match=what) as e:
            s.get(k, 1)
        assert f"`{k}`" in str(e.value)


def test_records_and_large_values_under_a_value_limit():
    class Limited(MemoryStore):
        max_value_bytes = 160

        def set(self, key, value):
            assert len(value) <= self.max_value_bytes, len(value)
            super().set(key, value)

    s = KeyedStore(Limited(), KEY)
    assert s.max_value_bytes == 160 - 36
    big = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    set_large(s, "big", big)
    assert get_large(s, "big", 1) == big
    set_record(s, "rec", {"v": 3})
    assert get_record(s, "rec", 1) == {"v": 3}
    with pytest.raises(wb.AuthError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        get_large(KeyedStore(s.store, OTHER), "big", 1)


def test_the_key_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("WB_JOB_KEY", raising=False)
    assert job_key() is None
    store = MemoryStore()
    with pytest.warns(wb.errors.WbWarning, match="no job key"):
        assert keyed(store) is store
    monkeypatch.setenv("WB_JOB_KEY", KEY)
    assert job_key() == KEY.encode()
    k = keyed(store)
    assert isinstance(k, KeyedStore) and keyed(k) is k
    with pytest.raises(wb.AuthError, match="at least 16 bytes"):
        job_key("short")


def test_a_job_over_a_keyed_store_in_threads(monkeypatch):
    """wb.LocalSession's workers sign and read through the key the environment gives."""
    monkeypatch.setenv("WB_JOB_KEY", KEY)
    sm = wb.SourceMap.from_indices(np.arange(64).reshape(8, 8))
    t = wb.Layout(wb.Worker(0, "a", "trainer"), {"w": wb.BufferSpec(sm, "float32")})
    r = wb.Layout(wb.Worker(1, "b", "rollout"), {"w": wb.BufferSpec(sm, "float32")})
    store = MemoryStore()
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    got = np.zeros_like(w)
    from harness.threads import run_each
    from wb.runtime.transport.local import LocalHub, LocalTransport

    hub, plan = LocalHub(), wb.plan([t], [r])

    def run(rank):
        kw = dict(transport=LocalTransport(rank, hub), store=store, timeout=20, wait_timeout=20)
        if rank == 0:
            with wb.Sender(plan, 0, {"w": w}, **kw) as tx:
                tx.push()
        else:
            with wb.Receiver(plan, 1, {"w": got}, **kw) as rx:
                assert rx.apply() == 1
    assert not run_each(run, [0, 1])
    assert np.array_equal(got, w)
    assert all(v.startswith(b"wbk1") for v in store._data.values())  # every record signed


# --- real processes -------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_a_process_with_another_key_is_refused_and_the_job_goes_on(tmp_path):
    """The job (2 trainers, 2 rollouts over UCX, the key from WB_JOB_KEY) pushes 4 versions
    while a process with another key writes records the job reads, sends junk under the tags
    of version 2 to a rollout, and asks to join: every rollout applies every version
    bit-identical, the stranger is never admitted, and nothing it wrote is taken."""
    import json
    import multiprocessing as mp

    from harness.multiproc import coord_child_main, run_ranks, stranger_main

    sm = wb.SourceMap.from_indices(np.arange(4096).reshape(64, 64))
    t = [wb.Layout(wb.Worker(r, "t", "trainer", r), {"w": wb.BufferSpec(sm[32 * r:32 * r + 32], "float32")})
         for r in range(2)]
    r = [wb.Layout(wb.Worker(2 + k, f"r{k}", "rollout"), {"w": wb.BufferSpec(sm, "float32")})
         for k in range(2)]
    wb.plan(t, r).save(tmp_path / "plan.npz")
    (tmp_path / "results").mkdir()
    stranger = mp.get_context("spawn").Process(target=stranger_main, daemon=True, args=(
        10, str(tmp_path / "plan.npz"), str(tmp_path / "store"), str(tmp_path / "results"),
        {"key": OTHER, "version": 2, "target": 2, "like": 3, "join_s": 12}))
    stranger.start()
    run = run_ranks(str(tmp_path / "plan.npz"), [0, 1, 2, 3], str(tmp_path),
                    target=coord_child_main, join_timeout=200,
                    options={"versions": 4, "timeout": 30, "step_s": 0.5,
                             "env": {"WB_JOB_KEY": KEY}})
    stranger.join(60)
    for rank in (0, 1, 2, 3):
        res = run.results[rank]
        assert res is not None and res["ok"], (rank, res)
        if rank >= 2:
            assert res["applied"] == [1, 2, 3, 4] and all(res["checks"]), res
    assert not any(rep.get("joined") for rep in run.results[0]["repairs"])
    s = json.loads((tmp_path / "results" / "10.json").read_text())
    assert s["ok"] and s["sent"] > 0 and s["admitted"] is False, s
    assert "not admitted" in s["join_error"] or "not signed" in s["join_error"], s


@pytest.mark.timeout(120)
def test_peers_answer_the_key_challenge_and_one_with_another_key_is_refused(tmp_path):
    """Two UCX transports in threads over a keyed store: set-up (connect, then prepare, where
    each answers the other's challenge) passes; a peer whose messages are keyed by another key
    (its store records still signed with the job's) is refused at set-up, named with its
    address, before any update."""
    from harness.threads import run_each
    from wb.runtime.transport.keyed import tag_secret
    from wb.runtime.transport.ucx import UcxTransport

    def pair(d, other_key_at_1=False):
        store = DirectoryStore(d)
        ts = {r: UcxTransport(r, KeyedStore(store, KEY), timeout=4) for r in (0, 1)}

        def run(r):
            t = ts[r]
            t.connect([1 - r], hello=b"x")
            if other_key_at_1 and r == 1:  # its messages now keyed otherwise
                t.store = KeyedStore(store, OTHER)
                t._secret = tag_secret(t.store, t.session)
            t.prepare([1 - r])
        errors = run_each(run, [0, 1])
        if errors:
            for t in ts.values():
                t.abort()
        else:  # the closing barrier: both at once
            assert not run_each(lambda r: ts[r].close(), [0, 1])
        return errors
    assert not pair(tmp_path / "good")
    errors = pair(tmp_path / "bad", other_key_at_1=True)
    assert isinstance(errors.get(0), wb.AuthError), errors
    assert "peer 1" in str(errors[0]) and "address" in str(errors[0]), errors


def _wait(req, deadline=8.0):
    import time

    end = time.monotonic() + deadline
    while not req.done():
        assert time.monotonic() < end, "not done"
        time.sleep(0.001)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stranger", [False, True])
def test_a_peer_met_after_set_up_is_challenged_before_its_messages_are_taken(tmp_path, stranger):
    """Ranks 0 and 1 set up (challenged at set-up); rank 2 comes later, as a joiner does (its
    address published, added as a peer, no set-up round). Its first message with rank 0 waits
    for its challenge: with the job's key it passes and the message lands, and later ones go
    at once; a process answering with another key (its message already sent to rank 0's worker
    under the right tag) is refused, naming it, and rank 0's buffer stays untouched."""
    from harness.threads import run_each
    from wb.runtime.transport.ucx import UcxTransport

    store = DirectoryStore(tmp_path)
    ts = {r: UcxTransport(r, KeyedStore(store, KEY), timeout=4) for r in (0, 1, 2)}
    data = np.arange(1, 4097, dtype=np.uint32).view(np.uint8)
    got, errors = np.zeros_like(data), {}

    def set_up(r):
        ts[r].connect([1 - r], hello=b"x")
        ts[r].prepare([1 - r])
    assert not run_each(set_up, [0, 1])
    ts[2].connect([], hello=b"")
    ts[0].add_peers([2])
    ts[2].add_peers([0])

    def run(r):
        t = ts[r]
        if r == 0:
            try:
                _wait(t.recv(2, got, 7))
                _wait(t.recv(2, got[:8], 8))  # the peer is trusted now: posted at once
                assert 2 in t._gate.trusted
            except wb.AuthError as e:
                errors[0] = e
        else:
            if stranger:  # answers the challenge with another key, posts its data directly
                t._ep(0)  # rank 0's address read with the job's key
                t.store = KeyedStore(store, OTHER)
                t._gate.key = t.store.key
                t._send(0, data, 7)
                try:
                    _wait(t.recv(0, np.zeros(8, np.uint8), 9))
                except wb.AuthError as e:
                    errors[2] = e
            else:
                _wait(t.send(0, data, 7))
                _wait(t.send(0, data[:8], 8))
    assert not run_each(run, [0, 2])
    if stranger:
        assert isinstance(errors.get(0), wb.AuthError), errors
        assert "peer 2" in str(errors[0]) and "another key" in str(errors[0]), errors
        assert "address" in str(errors[0]), errors
        assert not got.any()  # nothing of it landed
        for t in ts.values():
            t.abort()
    else:
        assert not errors, errors
        assert np.array_equal(got, data)
        assert not run_each(lambda r: ts[r].close(), [0, 1, 2])


def test_a_gate_posts_what_it_held_in_order_once_the_challenge_passes():
    """Gate over an in-process transport, both ranks stepped in turn: messages held until the
    challenge passes, then posted in the order they were asked for (the data lands whole); after
    a cancel, what was held is never posted; a forgotten peer's held message fails; another key
    is refused naming the peer."""
    from wb.runtime.transport.challenge import Gate
    from wb.runtime.transport.local import LocalHub, LocalTransport

    def pair(key_b=KEY.encode()):
        hub = LocalHub()
        a, b = LocalTransport(0, hub), LocalTransport(1, hub)
        return (Gate(a.send, a.recv, 0, KEY.encode(), timeout=5),
                Gate(b.send, b.recv, 1, key_b, timeout=5))

    ga, gb = pair()
    got = [np.zeros(4, np.uint8) for _ in range(3)]
    recvs = [ga.hold(1, t, lambda t=t: ga.recv(1, got[t], t)) for t in range(3)]
    sends = [gb.hold(0, t, lambda t=t: gb.send(0, np.full(4, t + 1, np.uint8), t))
             for t in (2, 1, 0)]  # the other side's own order
    assert not any(r.req for r in recvs + sends)  # nothing posted before the challenge
    for _ in range(1000):
        if all([r.done() for r in recvs] + [s.done() for s in sends]):  # both sides stepped
            break
    assert [int(g[0]) for g in got] == [1, 2, 3] and ga.trusted == {1} and gb.trusted == {0}

    ga, gb = pair()
    held = ga.hold(1, 5, lambda: pytest.fail("posted after a cancel"))
    ga.cancel()
    gb.hold(0, 6, lambda: None)
    with pytest.raises(wb.TransferError, match="cancelled"):
        held.done()
    later = ga.hold(1, 7, lambda: ga.recv(1, np.zeros(1, np.uint8), 7))
    ga.forget([1])
    with pytest.raises(wb.TransferError, match="dropped"):
        later.done()

    ga, gb = pair(OTHER.encode())
    x, y = ga.hold(1, 1, lambda: None), gb.hold(0, 1, lambda: None)
    with pytest.raises(wb.AuthError, match=r"peer [01] answered .*another key"):
        for _ in range(1000):
            x.done()
            y.done()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["cancelled", "died-before-answering", "died-after-its-nonce"])
def test_a_challenge_left_by_an_attempt_does_not_spoil_the_next(tmp_path, how):
    """A challenge between ranks 0 and 2 is left unfinished in version 2: rank 0 cancels the
    attempt (over the one-sided channel too, which drops its receives), or rank 2 dies before
    answering (rank 0 cancels and forgets it), or rank 2 dies right after sending its nonce
    (still unmatched at rank 0). In the next attempt (a new process of rank 2 where it died),
    the pair's challenge runs in that attempt's own round: it passes and the message lands."""
    import time

    from harness.threads import run_each
    from wb.runtime.transport.ucx import UcxTransport

    store = DirectoryStore(tmp_path)
    make = lambda r: UcxTransport(r, KeyedStore(store, KEY), timeout=4,  # noqa: E731
                                  ipc="host" if how == "cancelled" else "off")
    t0, t2 = make(0), make(2)
    for t, p in ((t0, 2), (t2, 0)):
        t.connect([], hello=b"")
        t.add_peers([p])
    v2, v3 = 2 << 32, 3 << 32
    if how == "died-after-its-nonce":
        h = t2.send(0, np.zeros(8, np.uint8), v2 + 7)
        for _ in range(50):
            h.done()
            time.sleep(0.002)
    else:
        h = t0.recv(2, np.zeros(8, np.uint8), v2 + 7)
        for _ in range(50):
            h.done()
            time.sleep(0.002)
        t0.cancel()
    if how != "cancelled":  # a new process of rank 2 asks to join; rank 0 drops the old one
        t2.abort()
        t0.forget([2])
        t2 = make(2)
        t2.connect([], hello=b"")
        t2.add_peers([0])
        t0.add_peers([2])
    got, data = np.zeros(64, np.uint8), np.arange(64, dtype=np.uint8)
    errors = run_each(lambda r: _wait(t0.recv(2, got, v3 + 5) if r == 0
                                      else t2.send(0, data, v3 + 5)), [0, 2])
    assert not errors, errors
    assert np.array_equal(got, data)
    t0.abort()
    t2.abort()


@pytest.mark.timeout(60)
def test_a_peer_whose_first_message_comes_later_than_the_timeout_is_not_refused(tmp_path):
    """Rank 0 posts its receive from rank 2 (a forwarder, say, whose send waits for its own
    data) and polls it for longer than the transports' timeout before rank 2 posts anything:
    the challenge waits for the peer to start (its update's stall timeout is what bounds that),
    then passes, and the message lands."""
    import time

    from harness.threads import run_each
    from wb.runtime.transport.ucx import UcxTransport

    store = DirectoryStore(tmp_path)
    ts = {r: UcxTransport(r, KeyedStore(store, KEY), timeout=1) for r in (0, 2)}
    for r in (0, 2):
        ts[r].connect([], hello=b"")
        ts[r].add_peers([2 - r])
    got, data = np.zeros(16, np.uint8), np.arange(16, dtype=np.uint8)

    def run(r):
        if r == 0:
            _wait(ts[0].recv(2, got, (4 << 32) + 3))
        else:
            time.sleep(1.5)
            _wait(ts[2].send(0, data, (4 << 32) + 3))
    assert not run_each(run, [0, 2])
    assert np.array_equal(got, data)
    for t in ts.values():
        t.abort()
