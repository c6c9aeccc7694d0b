"""A shared/exclusive gate around LMDB transactions, so the memory map can be resized safely.

LMDB requires that no transaction of this process is live while `set_mapsize` runs. Every
transaction holds the gate shared; a resize takes it exclusively, which first stops new
transactions from starting and then waits for the live ones to finish.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ResizeGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._num_active = 0
        self._resizing = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._resizing)
            self._num_active += 1
        try:
            yield
        finally:
            with self._cond:
                self._num_active -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Must not be entered by a thread that holds the gate shared (it would wait forever)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._resizing)
            self._resizing = True
            self._cond.wait_for(lambda: self._num_active == 0)
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()
