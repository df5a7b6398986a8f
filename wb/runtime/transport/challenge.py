"""The job key's challenge: a peer proves over the transport that it holds the key before any
message of an update goes to or from it.

Each side of a pair sends the other a fresh nonce and answers the other's with an HMAC of it and
both ranks; each checks the answer to its own (:class:`Challenge`, one pair, stepped without
blocking). At set-up every rank challenges the peers of its plan at once (:func:`challenge`,
blocking). A peer met later (a joiner, a restarted rank's new process, a pair that a new plan or
a repair brings together) is challenged where the first message with it is posted: a
:class:`Gate` holds that pair's messages, unposted, until its challenge passes, and posts them
all then, in order; messages with every other peer go on meanwhile. Both sides of a pair meet
it in the same update (a send is met by its receive), so both challenge it then.
"""

from __future__ import annotations

import hmac
import hashlib
import secrets
import time
from collections.abc import Callable, Iterable

import numpy as np

from wb.errors import AuthError, TransferError

__all__ = ["Challenge", "challenge", "Gate", "LATER"]

#: Tags of the challenge: above every tag an update uses (bit 63 set), per round and sender.
_TAG = 1 << 63
#: Rounds of challenges where a pair meets after set-up: this bit, and the version and attempt
#: of the update whose first message with the peer started it (a message's tag carries them above
#: bit 27: ``wb.runtime.membership.finish.tag_base``), so both sides of the pair use the same
#: round, and nothing of an earlier attempt (a receive a cancel left posted, a dead process's
#: late nonce) is taken for it. Set-up's rounds are the transport's connect rounds, small numbers.
LATER = 1 << 22


def later_round(tag: int) -> int:
    """The round of a challenge started by a message of ``tag``."""
    return LATER | (int(tag) >> 27) & (LATER - 1)


def _answer(key: bytes, nonce: bytes, frm: int, to: int) -> bytes:
    return hmac.new(key, b"wb challenge\0" + nonce + frm.to_bytes(8, "little")
                    + to.to_bytes(8, "little"), hashlib.sha256).digest()


class Challenge:
    """One pair's challenge, this rank's side: its nonce and receives posted at once,
    :meth:`step` answers the peer's nonce and checks the peer's answer as they come.

    Args:
        send, recv: ``(peer, buf, tag) -> Request`` of the transport, not held by a gate.
        me, peer: the ranks.
        key: the job's key.
        round_: keeps rounds' messages apart (both sides use the same).
        timeout: seconds the peer has to answer once its nonce came (a peer that has not
            started yet is waited for: its side's update may start later; what waits for it
            says how long, as an update's stall timeout does).
        where: ``peer -> str``: how an error names the peer's address.
    """

    def __init__(self, send, recv, me: int, peer: int, key: bytes, *, round_: int,
                 timeout: float, where: Callable[[int], str] = lambda p: ""):
        self.send, self.me, self.peer, self.key, self.where = send, me, peer, key, where
        self.round, self.timeout, self.deadline = round_, timeout, None
        base = _TAG | (int(round_) & 0x7FFFFF) << 40
        self._tag = lambda kind, frm: base | kind << 32 | frm  # kind 1 nonce, 2 answer
        self.nonce = secrets.token_bytes(16)
        self._theirs, self._answer = np.zeros(16, np.uint8), np.zeros(32, np.uint8)
        self._got = (recv(peer, self._theirs, self._tag(1, peer)),
                     recv(peer, self._answer, self._tag(2, peer)))
        self.sent = [send(peer, np.frombuffer(self.nonce, np.uint8).copy(), self._tag(1, me))]
        self.answered = self.checked = False

    def step(self) -> bool:
        """Whether the peer has proved the key, and this side's nonce and answer have left.

        Raises:
            AuthError: the peer answered with another key, or not within ``timeout`` of its
                nonce."""
        if not self.answered and self._got[0].done():
            ans = _answer(self.key, self._theirs.tobytes(), self.me, self.peer)
            self.sent.append(self.send(self.peer, np.frombuffer(ans, np.uint8).copy(),
                                       self._tag(2, self.me)))
            self.answered = True
            self.deadline = time.monotonic() + self.timeout
        if not self.checked and self._got[1].done():
            if not hmac.compare_digest(self._answer.tobytes(),
                                       _answer(self.key, self.nonce, self.peer, self.me)):
                raise self.refuse("answered the job key's challenge with another key")
            self.checked = True
        # and what this side sent has left: a request dropped before then may never be sent
        # (a transport that submits posts later, from its progress thread)
        if self.answered and self.checked and all(r.done() for r in self.sent):
            return True
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise self.refuse("sent its nonce but did not answer this rank's within "
                              f"{self.timeout:.0f} s")
        return False

    def open(self) -> bool:
        """Whether a receive of this challenge may still be written into (not complete, not
        failed: a cancelled one fails)."""
        try:
            return not all(r.done() for r in self._got)
        except TransferError:
            return False

    def refuse(self, why: str) -> AuthError:
        err = AuthError(f"rank {self.me}: peer {self.peer}{self.where(self.peer)} {why}; "
                        f"refused")
        err.peer = self.peer  # an update may go on without it (wb.runtime.membership.finish)
        return err


def challenge(send, recv, me: int, peers: Iterable[int], key: bytes, *, round_: int,
              timeout: float, where: Callable[[int], str] = lambda p: "",
              progress: Callable[[], None] | None = None) -> None:
    """Every one of ``peers`` proves that it holds ``key`` (each challenges this rank back at
    the same time: posts first, then waits, so no order among ranks is needed); returns once
    all have and this rank's messages have left.

    Raises:
        AuthError: a peer answered with another key, or not within ``timeout`` (another key
            keys its tags otherwise: its answer never reaches this rank), naming it.
    """
    pending = [Challenge(send, recv, me, p, key, round_=round_, timeout=timeout, where=where)
               for p in peers]
    deadline = time.monotonic() + timeout
    while pending:
        if progress is not None:
            progress()
        pending = [c for c in pending if not c.step()]
        if pending and time.monotonic() > deadline:
            late = ", ".join(f"{c.peer}{where(c.peer)}" for c in pending)
            raise AuthError(f"rank {me}: peer{'s' if len(pending) > 1 else ''} {late} did not "
                            f"answer the job key's challenge within {timeout:.0f} s: its "
                            f"messages are keyed otherwise (another key), or it is dead, slow, "
                            f"or in another connect round; refused")
        if pending:
            time.sleep(0.0005)


class _Held:
    """A send or receive a :class:`Gate` holds until its peer's challenge passes."""

    __slots__ = ("gate", "peer", "tag", "post", "req", "error")

    def __init__(self, gate: Gate, peer: int, tag: int, post: Callable):
        self.gate, self.peer, self.tag, self.post = gate, peer, tag, post
        self.req = self.error = None

    def done(self) -> bool:
        if self.req is None:
            if self.error is None and not self.gate.passed(self.peer):
                return False
            if self.error is not None:
                raise self.error
        return self.req.done()

    def fail(self, why: str) -> None:
        self.error = TransferError(f"rank {self.gate.me}: a message of tag {self.tag:#x} with "
                                   f"peer {self.peer} {why}")
        self.error.peer = self.peer


class Gate:
    """The peers a keyed transport has challenged (:attr:`trusted`), and the messages it holds
    for the others until their challenge passes.

    Args:
        send, recv: the transport's own posts (not held).
        me: its rank.
        key: the job's key.
        timeout: seconds a peer has to answer once its nonce came.
        where: ``peer -> str`` for errors.
    """

    def __init__(self, send, recv, me: int, key: bytes, *, timeout: float,
                 where: Callable[[int], str] = lambda p: ""):
        self.send, self.recv, self.me, self.key = send, recv, me, key
        self.timeout, self.where = timeout, where
        self.trusted: set[int] = set()
        self._pending: dict[int, tuple[Challenge, list[_Held]]] = {}
        self._left: list[Challenge] = []  # dropped, their receives kept until they complete

    def hold(self, peer: int, tag: int, post: Callable) -> _Held:
        """A request whose ``post()`` runs once ``peer`` (not trusted) has passed its
        challenge: the one under way for this update's attempt, or one started now (a
        challenge of an earlier attempt is dropped, with what it held)."""
        round_ = later_round(tag)
        entry = self._pending.get(peer)
        if entry is None or entry[0].round != round_:
            if entry is not None:
                self._drop(peer, "was held for an attempt that was left")
            entry = self._pending[peer] = (
                Challenge(self.send, self.recv, self.me, peer, self.key, round_=round_,
                          timeout=self.timeout, where=self.where), [])
        held = _Held(self, peer, tag, post)
        entry[1].append(held)
        return held

    def passed(self, peer: int) -> bool:
        """Steps ``peer``'s challenge; once it passes, posts every message held for it, in the
        order they were asked for (the peer posts its side in its own order: none may wait
        for another still held). A failed challenge fails all of them (each raises it)."""
        if peer in self.trusted:
            return True
        ch, held = self._pending[peer]
        try:
            if not ch.step():
                return False
        except AuthError as e:
            del self._pending[peer]
            for h in held:
                h.error = e
            return True
        del self._pending[peer]
        self.trusted.add(peer)
        for h in held:
            try:
                h.req = h.post()
            except TransferError as e:
                e.peer = getattr(e, "peer", None) or peer
                h.error = e
        return True

    def _drop(self, peer: int, why: str) -> None:
        ch, held = self._pending.pop(peer)
        for h in held:
            h.fail(why)
        # a receive posted may still be written into (a late message): its buffer stays alive
        self._left = [c for c in (*self._left, ch) if c.open()]

    def forget(self, peers: Iterable[int]) -> None:
        """Drops ``peers`` (dead, or replaced by a new process: met anew, challenged anew)."""
        for p in peers:
            self.trusted.discard(p)
            if p in self._pending:
                self._drop(p, "was dropped (dead or replaced) before it answered the job "
                              "key's challenge")

    def cancel(self) -> None:
        """Drops the challenges under way and what they hold (the update was abandoned; the
        next attempt challenges anew in its own round: a cancel may leave this attempt's
        receives posted, or take them from the one-sided channel)."""
        for p in list(self._pending):
            self._drop(p, "was cancelled before its peer answered the job key's challenge")
