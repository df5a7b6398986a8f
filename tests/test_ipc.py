"""UcxTransport's one-sided channel (wb.runtime.transport.ipc) on hosts: the same protocol as
between GPUs (notes in batches, the receiver copies, acks in batches, fallbacks over UCX), with
host memory read by ``process_vm_readv``; between spawned processes over UCX on loopback."""

import contextlib
import json
import threading

import numpy as np
import pytest

pytest.importorskip("ucxx")

from harness.ipc import run_pair  # noqa: E402
from wb.runtime.transport.ucx import cma_usable  # noqa: E402

pytestmark = pytest.mark.skipif(not cma_usable(), reason="process_vm_readv refused here")


@contextlib.contextmanager
def _pair(tmp_path, session: str):
    """Ranks 0 and 1 as UcxTransports over the one-sided host channel, connected to each other
    (each from a thread of its own, as two processes would), closed after."""
    from wb.runtime.transport.stores import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    store = DirectoryStore(str(tmp_path))
    t = [UcxTransport(r, store, session=session, timeout=20, ipc="host") for r in (0, 1)]
    _each(t, lambda x: x.connect([1 - x.rank]))
    try:
        yield t
    finally:
        _each(t, lambda x: x.close(barrier=False))


def _each(transports, fn) -> None:
    ths = [threading.Thread(target=fn, args=(x,)) for x in transports]
    [th.start() for th in ths]
    [th.join() for th in ths]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late", [False, True], ids=["receives-first", "notes-first"])
def test_messages_arrive_exactly_one_sided(tmp_path, late):
    """150 messages of 1 byte to 4 MiB from random offsets into others: every byte exact; each
    went one-sided (the receiver copied it, most of them several to one call) and the sender saw
    it acknowledged."""
    res = run_pair(str(tmp_path), ipc="host", count=150, cuda=None, late=late)
    assert all("error" not in r for r in res), res
    assert res[1]["exact"]
    assert res[1]["counts"].pop("batched") > 75 and res[0]["counts"].pop("batched") == 0
    assert res[0]["counts"] == res[1]["counts"] == {"one_sided": 150, "over_ucx": 0, "nacked": 0,
                                                    "unpacked": 0, "hashed": 0}


@pytest.mark.timeout(120)
def test_memory_the_receiver_cannot_read_is_nacked_and_sent_over_ucx(tmp_path, monkeypatch):
    """Two ranks in threads of one process, the receiver unable to read any note's memory (as
    when CUDA refuses to open a handle): each message is nacked, then sent over UCX tags; every
    byte still exact."""
    from wb.runtime.transport import memory

    monkeypatch.setattr(memory.HostMemory, "copy", lambda *a, **k: None)
    monkeypatch.setattr(memory.HostMemory, "copy_many", lambda *a, **k: None)
    res = run_pair(str(tmp_path), threads=True, ipc="host", count=40, cuda=None, late=False)
    assert all("error" not in r for r in res), res
    assert res[1]["exact"]
    assert res[1]["counts"] == {"one_sided": 0, "over_ucx": 0, "nacked": 40, "batched": 0,
                                "unpacked": 0, "hashed": 0}
    # the first nack marks the sender's memory refused: the rest go over UCX without a note's
    # round trip, or after their own nack when already noted
    assert res[0]["counts"]["over_ucx"] == 40


@pytest.mark.timeout(120)
def test_a_receive_of_another_size_is_refused_at_both_ends(tmp_path):
    from wb.errors import TransferError

    with _pair(tmp_path, "sz") as t:
        s = t[0].send(1, np.ones(100, np.uint8), 5)
        r = t[1].recv(0, np.zeros(90, np.uint8), 5)
        errors = {}
        for _ in range(100000):
            for name, q in (("send", s), ("recv", r)):
                if name not in errors:
                    try:
                        q.done()
                    except TransferError as e:
                        errors[name] = str(e)
            if len(errors) == 2:
                break
        assert "90 bytes, the peer sent 100" in errors["recv"]
        assert "not 100 bytes" in errors["send"]


@pytest.mark.timeout(180)
def test_a_plan_runs_bit_identical_one_sided(tmp_path, monkeypatch):
    """The executor's own messages (packed, zero-copy, forwards, frames, digests) one-sided
    between spawned processes: every rollout buffer bit-identical."""
    import sys
    from pathlib import Path

    import wb
    from harness.multiproc import run_ranks

    sys.path.insert(0, str(Path(__file__).parent))
    from test_plan import deployment

    monkeypatch.setenv("WB_IPC", "host")
    trainers, rollouts = deployment()
    p = wb.plan(trainers, rollouts, chunk_bytes=256)
    p.save(tmp_path / "plan.npz")
    ranks = [lay.worker.rank for lay in (*trainers, *rollouts)]
    run = run_ranks(str(tmp_path / "plan.npz"), ranks, str(tmp_path), options={"timeout": 60})
    assert all(run.results[r] and run.results[r]["ok"] for r in ranks), run.results
    assert all(run.results[lay.worker.rank]["bit_identical"] for lay in rollouts)


@pytest.mark.timeout(120)
def test_a_send_over_ucx_done_at_once_still_cues_its_receiver(tmp_path, monkeypatch):
    """Memory that cannot be exported goes as a UCX send, which may be done as soon as posted (a
    small eager message): its note, the receiver's cue to post the receive, must go out at
    once, not at a later pump that a finished update never makes."""
    from wb.runtime.transport import memory

    monkeypatch.setattr(memory.HostMemory, "export", lambda self, buf: None)
    # seed 25: three messages of 641-2,223 bytes (eager: done as posted)
    res = run_pair(str(tmp_path), threads=True, ipc="host", count=3, cuda=None, late=True,
                   seed=25)
    assert all("error" not in r for r in res), res
    assert res[1]["exact"] and res[1]["counts"]["over_ucx"] == 3


def test_a_process_that_takes_a_dead_ranks_place_is_numbered_apart():
    """UCX cannot withdraw a posted receive: the control receives a rank keeps posted for a dead
    peer stay. A process that takes that rank numbers its control messages from its own start
    (its record's ``seq0``), so none of them lands in those; the same process met again (a peer
    forgotten, then back) keeps its numbering."""
    from wb.runtime.transport.ipc import CTRL_TAG, WINDOW, Channel
    from wb.runtime.transport.memory import HostMemory

    posted = []

    class _T:
        rank = 0

        def _post(self, what, peer, buf, tag):
            posted.append((what, peer, tag))
            return _Pending()

        def progress(self):
            pass

    c = Channel(_T(), HostMemory())
    c.meet(3, 1000)
    first = [tag for _, _, tag in posted]
    assert first == [CTRL_TAG | 3 << 32 | (1000 + k) for k in range(WINDOW)]
    c.forget([3])
    c.meet(3, 1000)  # the same process: nothing posted again
    assert len(posted) == WINDOW
    c.meet(3, 77)  # another process in rank 3's place
    again = {tag for _, _, tag in posted[WINDOW:]}
    assert again == {CTRL_TAG | 3 << 32 | (77 + k) for k in range(WINDOW)}
    assert not again & set(first)
    c.send(3, np.zeros(8, np.uint8), 9)
    c.pump()
    assert posted[-1] == ("send", 3, CTRL_TAG | 0 << 32 | c.seq0)  # from its own start


class _Pending:
    class req:  # noqa: N801 - the shape of a UCX request: never completes
        completed = False


class _Done:
    class req:  # noqa: N801
        completed = True


class _Eager:
    """A transport whose control sends complete as posted (recorded) and whose receives never do."""

    def __init__(self, rank):
        self.rank, self.sent = rank, []

    def _post(self, what, peer, buf, tag):
        if what == "send":
            self.sent.append(bytes(buf))
            return _Done()
        return _Pending()

    def progress(self):
        pass


def test_a_cancel_still_acknowledges_what_was_copied():
    """A rank that gives an attempt up still acks what it already copied: a sender that stays
    in the attempt (not every rank gives it up) would otherwise wait for those acks forever."""
    from wb.runtime.transport.ipc import Channel
    from wb.runtime.transport.notes import ACK_OK, HEADER, NOTE_IPC, ROW
    from wb.runtime.transport.memory import HostMemory

    mem, t = HostMemory(), _Eager(1)
    c = Channel(t, mem)
    c.meet(0, 0)
    src = np.arange(64, dtype=np.uint8)
    handle, addr = mem.export(src)
    c._notes[0, 5] = (NOTE_IPC, 64, handle, addr)  # the sender's note came first
    dst = np.zeros(64, np.uint8)
    c.recv(0, dst, 5)  # copied at once (host memory), its ack not yet sent
    c.cancel()
    assert (dst == src).all()
    rows = []
    for msg in t.sent:
        n, _ = HEADER.unpack_from(msg)
        rows += np.frombuffer(msg, ROW, n, HEADER.size).tolist()
    assert [(r[0], r[4]) for r in rows] == [(5, ACK_OK)]


def test_a_note_that_came_before_a_cancel_is_still_received():
    """A sender already in the next attempt (its tags are new) may note a message before this
    rank gives its own attempt up: the note stays through the cancel, as UCX keeps unexpected
    messages, and the receive posted in the next attempt takes it."""
    from wb.runtime.transport.ipc import Channel
    from wb.runtime.transport.notes import ACK_OK, HEADER, NOTE_IPC, ROW
    from wb.runtime.transport.memory import HostMemory

    mem, t = HostMemory(), _Eager(1)
    c = Channel(t, mem)
    c.meet(0, 0)
    src = np.arange(64, dtype=np.uint8) * 3
    handle, addr = mem.export(src)
    c._read(0, _batch([(9, 64, addr, 0, NOTE_IPC)], [handle]))  # before any receive for it
    c.cancel()
    dst = np.zeros(64, np.uint8)
    req = c.recv(0, dst, 9)
    assert req.done() and (dst == src).all()
    n, _ = HEADER.unpack_from(t.sent[-1])
    assert [(r[0], r[4]) for r in np.frombuffer(t.sent[-1], ROW, n, HEADER.size).tolist()] == \
        [(9, ACK_OK)]


def _batch(rows, handles):
    """A control message as a peer's channel sends it."""
    from wb.runtime.transport.notes import HEADER, ROW

    arr = np.array(rows, ROW)
    return np.frombuffer(HEADER.pack(len(rows), len(handles)) + arr.tobytes() + b"".join(handles),
                         np.uint8)


@pytest.mark.timeout(120)
def test_a_receive_its_caller_can_unpack_is_unpacked_from_the_senders_memory(tmp_path,
                                                                             monkeypatch):
    """A receive posted with ``unpack=(unpacker, key)`` is handed to the unpacker with the
    sender's bytes where they lie (here: host memory given an ``unpack_many`` that reads them
    with ``process_vm_readv``, as CUDA's runs the unpacking kernel on the opened memory): its
    buffer stays untouched, the request says ``unpacked``, the sender's send completes with the
    ack. Where the memory cannot (``None``), the message is copied into the buffer as any."""
    import time

    from wb.runtime.transport import memory

    refuse = {3}  # the memory fails a group holding this key: copied instead

    def unpack_many(self, items, peer):
        if any(key in refuse for (_, key), *_ in items):
            return None
        for (unpacker, key), pid, address, nbytes in items:
            got = np.empty(nbytes, np.uint8)
            assert self.copy(got, pid, address, nbytes, peer)
            unpacker.unpack_many([(key, got)])
        return True

    class Unpacker:
        def __init__(self):
            self.into = {}

        def unpack_many(self, items):
            for key, data in items:
                self.into[key] = data[::-1].copy()  # another layout than the message's

    monkeypatch.setattr(memory.HostMemory, "unpack_many", unpack_many, raising=False)
    rng = np.random.default_rng(7)
    msgs = [rng.integers(0, 256, 1000 + 37 * k, dtype=np.uint8) for k in range(8)]
    with _pair(tmp_path, "up") as t:
        assert not t[1].unpacks_from(0)  # the transport offers it for CUDA memory only
        into = Unpacker()
        bufs = [np.zeros_like(m) for m in msgs]
        recvs, sends = {}, {}
        for keys in ([3], [0, 1, 2, 4, 5, 6, 7]):  # 3 alone: its memory refuses it
            for k in keys:
                recvs[k] = t[1].recv(0, bufs[k], 100 + k, unpack=(into, k) if k % 2 else None)
                sends[k] = t[0].send(1, msgs[k], 100 + k)
            reqs = [recvs[k] for k in keys] + [sends[k] for k in keys]
            end = time.monotonic() + 20
            while not all([q.done() for q in reqs]) and time.monotonic() < end:
                time.sleep(1e-4)
            assert all(q.done() for q in reqs)
        for k in range(8):
            unpacked = k % 2 == 1 and k not in refuse
            assert recvs[k].unpacked is unpacked, k
            if unpacked:
                assert not bufs[k].any() and np.array_equal(into.into[k], msgs[k][::-1])
            else:
                assert np.array_equal(bufs[k], msgs[k]) and k not in into.into


@pytest.mark.timeout(120)
def test_a_receive_posted_hashed_is_copied_by_its_hasher_in_one_pass(tmp_path, monkeypatch):
    """A receive posted with ``hashed=(hasher, key)`` is copied by the hasher (here: host
    memory given a ``copy_hashed`` that reads with ``process_vm_readv`` and hands each copy to
    it, as CUDA's hands the rows to one launch of the copy-and-CRC kernel): its buffer holds the
    message, the request says ``hashed``, the hasher saw each key once with the message's bytes.
    Receives posted to unpack, hashed and plain in the same turn go in groups of their own kind;
    where the memory refuses a group (``None``) its messages are copied plainly, not hashed."""
    import time

    from wb.runtime.engine import crc
    from wb.runtime.transport import memory

    refuse = {3}  # the memory fails a group holding this key: copied plainly
    groups = []  # the kind of each group handed to the memory

    def copy_hashed(self, items, peer):
        groups.append("hashed")
        if any(key in refuse for (_, key), *_ in items):
            return None
        for (hasher, key), buf, pid, address, nbytes in items:
            assert self.copy(buf, pid, address, nbytes, peer)
            hasher.copy_many([(key, buf, nbytes)], None)
        return True

    def unpack_many(self, items, peer):
        groups.append("unpack")
        for (unpacker, key), pid, address, nbytes in items:
            got = np.empty(nbytes, np.uint8)
            assert self.copy(got, pid, address, nbytes, peer)
            unpacker.into[key] = got
        return True

    class Hasher:
        def __init__(self):
            self.sums = {}

        def copy_many(self, items, stream):
            for key, buf, nbytes in items:
                assert key not in self.sums and buf.nbytes == nbytes
                self.sums[key] = crc.host(buf)

    monkeypatch.setattr(memory.HostMemory, "copy_hashed", copy_hashed, raising=False)
    monkeypatch.setattr(memory.HostMemory, "unpack_many", unpack_many, raising=False)
    rng = np.random.default_rng(8)
    msgs = [rng.integers(0, 256, 900 + 41 * k, dtype=np.uint8) for k in range(9)]
    with _pair(tmp_path, "hs") as t:
        assert not t[1].copies_hashed  # the transport offers it for CUDA memory only
        hasher, unpacker = Hasher(), type("U", (), {"into": {}})()
        bufs = [np.zeros_like(m) for m in msgs]
        recvs, sends = {}, {}
        kind = {k: ("hashed", "unpack", "plain")[k % 3] for k in range(9)}  # 3: refused
        for keys in ([3], [0, 1, 2, 4, 5, 6, 7, 8]):
            groups.clear()
            for k in keys:
                opt = ({"hashed": (hasher, k)} if kind[k] == "hashed" else
                       {"unpack": (unpacker, k)} if kind[k] == "unpack" else {})
                recvs[k] = t[1].recv(0, bufs[k], 200 + k, **opt)
            for k in keys:  # the notes come after every receive is posted: matched together
                sends[k] = t[0].send(1, msgs[k], 200 + k)
            reqs = [recvs[k] for k in keys] + [sends[k] for k in keys]
            end = time.monotonic() + 20
            while not all([q.done() for q in reqs]) and time.monotonic() < end:
                time.sleep(1e-4)
            assert all(q.done() for q in reqs)
            if len(keys) > 1:  # matched in one turn (here: always) the unpacks go first
                assert set(groups) == {"unpack", "hashed"}
                assert len(groups) > 2 or groups == ["unpack", "hashed"]
        for k in range(9):
            hashed = kind[k] == "hashed" and k not in refuse
            assert recvs[k].hashed is hashed, k
            if kind[k] == "unpack":
                assert np.array_equal(unpacker.into[k], msgs[k]) and not bufs[k].any()
            else:
                assert np.array_equal(bufs[k], msgs[k]), k
            assert (hasher.sums.get(k) == crc.host(msgs[k])) if hashed else k not in hasher.sums
        assert json.loads(t[1].describe())["one_sided"]["hashed"] == 2  # keys 0 and 6


@pytest.mark.timeout(120)
def test_copies_hashed_that_fail_once_queued_fail_their_receives(tmp_path, monkeypatch):
    """Where the memory queued a group's copies and hashing and then failed, it hands back a
    token that fails them: their receives raise, naming the peer and the error (copied again
    plainly, each would be hashed twice, and the two CRCs would cancel out)."""
    import time

    import wb
    from wb.runtime.transport import memory

    def copy_hashed(self, items, peer):
        for (hasher, key), buf, pid, address, nbytes in items:
            assert self.copy(buf, pid, address, nbytes, peer)
        return memory._Failed(RuntimeError("the event could not be recorded"))

    monkeypatch.setattr(memory.HostMemory, "copy_hashed", copy_hashed, raising=False)
    monkeypatch.setattr(memory.HostMemory, "passed", lambda self, token: (
        token.done if isinstance(token, memory._Failed) else True))
    with _pair(tmp_path, "hf") as t:
        msg, buf = np.arange(5000, dtype=np.uint8), np.zeros(5000, np.uint8)
        recv = t[1].recv(0, buf, 300, hashed=(object(), 0))
        send = t[0].send(1, msg, 300)
        end, err = time.monotonic() + 20, None
        while time.monotonic() < end:
            send.done()  # the sender's turn: its note goes out
            try:
                if recv.done():
                    break
            except wb.TransferError as e:
                err = e
                break
            time.sleep(1e-4)
        assert err is not None and "from peer 0 failed" in str(err)
        assert "could not be recorded" in str(err)
