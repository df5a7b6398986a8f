"""Helpers of in-process tests: workers as threads, load functions that count their calls."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


def together(*makers: Callable[[], Any], timeout: float = 60.0) -> list:
    """Runs every ``maker()`` at once, each in its own thread (workers that connect to each other
    must be made together); returns their results in order and raises the first error."""
    out: list = [None] * len(makers)
    errors = run_each(lambda i: out.__setitem__(i, makers[i]()), range(len(makers)),
                      timeout=timeout)
    if errors:
        raise next(iter(errors.values()))
    return out


def run_each(fn: Callable[[Any], Any], items: Iterable, *, timeout: float = 60.0) -> dict:
    """``fn(item)`` for every item at once, each in its own thread; returns ``{item: error}`` of
    those that raised. Fails if a thread is still running after ``timeout`` (a hung worker)."""
    errors: dict = {}

    def run(x):
        try:
            fn(x)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            errors[x] = e
    threads = [threading.Thread(target=run, args=(x,)) for x in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return errors


def counting(load: Callable) -> tuple[Callable, list]:
    """``load`` and a list that gets one entry per call of it."""
    calls: list = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        return load(*args, **kwargs)
    return wrapped, calls
