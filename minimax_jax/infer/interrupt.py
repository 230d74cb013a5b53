"""Ctrl-C as a flag: ``with InterruptFlag() as flag: ... if flag.set: stop`` between steps.

Inside the block the first SIGINT only sets ``flag.set`` (nothing is raised inside a running jitted
call or a half-updated engine); the generation loop checks it between prefill chunks and decode
steps. A second SIGINT aborts at once: it prints ``message`` to stderr and ends the process with
status ``EXIT_INTERRUPTED`` (``os._exit``: no interpreter teardown while XLA threads are busy). The
previous handler is restored on exit. Outside the main thread the block does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["EXIT_INTERRUPTED", "InterruptFlag"]

#: Exit status of an interrupted command (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130


class InterruptFlag:
    """SIGINT -> ``self.set = True``; a second one -> print ``message``, ``os._exit(130)``."""

    def __init__(self, message: str = "interrupted (Ctrl-C twice): aborted"):
        self.message = message
        self.set = False
        self._previous = None

    def __call__(self) -> bool:
        return self.set

    def _handle(self, _signum, _frame) -> None:
        if self.set:
            sys.stdout.flush()
            print(self.message, file=sys.stderr, flush=True)
            os._exit(EXIT_INTERRUPTED)
        self.set = True

    def __enter__(self) -> "InterruptFlag":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
