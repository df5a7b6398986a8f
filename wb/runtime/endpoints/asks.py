"""Weight checks asked for from outside a running job (``python -m wb check``).

A worker that serves checks (:meth:`wb.Sender.serve_checks`, :meth:`wb.Receiver.serve_checks`)
says so in the store (``<name>/check/serving/<rank>``: its role) and looks for *asks*
(``<name>/check/ask/<n>``, ``n = 0, 1, ...``, written by :func:`ask`) at its own ``push`` or
``apply``, at most every :data:`POLL_S` seconds while none is open:

- a trainer, while ask ``n`` is open (no ``<name>/check/closed/<n>``), claims every version it
  pushes (:meth:`wb.Sender.claim`) and answers ``<name>/check/answer/<n>/<rank>`` with the last
  version it claimed and the first (``since``);
- a rollout answers at its first ``apply`` of a version every trainer claims (at or after every
  trainer's ``since``; the claim itself may still be on its way: the check waits for it): it
  checks its live buffers (:meth:`wb.Receiver.check`) and answers with the report.

:func:`gather` collects the answers of every serving rollout and closes the ask. The records go
through the job's store like every other, signed with its key where it has one (a stranger can
neither ask nor answer). Nothing is checked between two of a worker's own calls: a loop that
stopped pushing or applying answers nothing (the gathering says who did not answer).
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable

from wb.errors import TransferError, WbWarning

__all__ = ["POLL_S", "Desk", "ask", "serving", "gather", "claimed_since"]

#: Seconds between a worker's looks for a new ask (each one store read).
POLL_S = 1.0
_GAP = 16  # ranks are looked for up to this many missing in a row


def _key(name: str, *parts) -> str:
    return "/".join((name, "check", *map(str, parts)))


def _try(store, key: str) -> bytes | None:
    """The value under ``key`` if it is there now, else ``None`` (one look)."""
    try:
        return store.get(key, 1e-3)
    except TransferError as e:
        if "was not published" in str(e):
            return None
        raise


class Desk:
    """One worker's answering of asks (see the module doc).

    Args:
        store, name: the job's store (keyed as the worker's) and name.
        rank, role: the worker (``"trainer"`` or ``"rollout"``).
        act: called with an open ask's number at each look while it is open: the answer (a
            JSON-able dict), or ``None`` while it cannot answer yet (a rollout whose version no
            trainer claimed yet). A trainer's stays open until the ask is closed.
    """

    def __init__(self, store, name: str, rank: int, role: str,
                 act: Callable[[int], dict | None]):
        self.store, self.name, self.rank, self.role, self.act = store, name, rank, role, act
        self.next, self.open, self.last = 0, None, float("-inf")
        self._warned = False
        store.set(_key(name, "serving", rank), role.encode())

    def poll(self) -> None:
        """One look (each ``push`` or ``apply``). A look that fails (the store, the check) warns
        once; the worker's own work goes on."""
        try:
            self._poll()
        except Exception as e:  # noqa: BLE001 - a check asked from outside never stops the job
            if not self._warned:
                self._warned = True
                warnings.warn(f"rank {self.rank}: answering weight checks failed: {e}", WbWarning,
                              stacklevel=3)

    def _poll(self) -> None:
        s, name = self.store, self.name
        if self.open is None:
            now = time.monotonic()
            if now - self.last < POLL_S:
                return
            self.last = now
            while _try(s, _key(name, "ask", self.next)) is not None:
                if _try(s, _key(name, "closed", self.next)) is None:
                    self.open = self.next
                    break
                self.next += 1  # closed before this worker looked: not its to answer
            if self.open is None:
                return
        n = self.open
        if _try(s, _key(name, "closed", n)) is not None:
            self.open, self.next = None, n + 1
            return
        answer = self.act(n)
        if answer is None:
            return
        s.set(_key(name, "answer", n, self.rank),
              json.dumps({"role": self.role, **answer}).encode())
        if self.role == "rollout":  # answered once; a trainer claims on until it is closed
            self.open, self.next = None, n + 1


def claimed_since(store, name: str, n: int, trainers) -> int | None:
    """The version from which every trainer claims for ask ``n`` (the latest of their first
    claims), or ``None`` while one has not answered yet."""
    since = None
    for t in trainers:
        raw = _try(store, _key(name, "answer", n, t))
        if raw is None:
            return None
        v = int(json.loads(raw)["since"])
        since = v if since is None else max(since, v)
    return since


def serving(store, name: str) -> dict[int, str]:
    """``{rank: role}`` of the workers of job ``name`` that serve checks (ranks looked for from
    0 until :data:`_GAP` in a row are missing)."""
    out, r, miss = {}, 0, 0
    while miss < _GAP:
        raw = _try(store, _key(name, "serving", r))
        if raw is None:
            miss += 1
        else:
            out[r], miss = raw.decode(), 0
        r += 1
    return out


def ask(store, name: str) -> int:
    """Opens a new ask of job ``name``; returns its number."""
    n = 0
    while _try(store, _key(name, "ask", n)) is not None:
        n += 1
    store.set(_key(name, "ask", n), json.dumps({"t": time.time()}).encode())
    return n


def gather(store, name: str, n: int, ranks: dict[int, str], *, timeout: float,
           on_answer: Callable[[int, dict], None] | None = None) -> dict[int, dict]:
    """Waits (up to ``timeout`` s) for every serving rollout's answer to ask ``n``, then closes
    it; returns ``{rank: answer}`` of those that answered (trainers' too: what they claimed)."""
    got: dict[int, dict] = {}
    rollouts = {r for r, role in ranks.items() if role == "rollout"}
    deadline = time.monotonic() + timeout
    while True:
        for r in ranks.keys() - got.keys():  # a trainer's first answer says what it claims
            raw = _try(store, _key(name, "answer", n, r))
            if raw is not None:
                got[r] = json.loads(raw)
                if on_answer is not None:
                    on_answer(r, got[r])
        if rollouts <= got.keys() or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    store.set(_key(name, "closed", n), b"1")
    return got
