"""Ctrl-C and SIGTERM for the command-line tools; a second Ctrl-C aborts at once (exit status 130).

``StopSignals`` (training): the first SIGINT / SIGTERM only records itself (``StopSignals.signum``);
the loop finishes the step in hand, saves a checkpoint and returns. A second SIGINT ends the process
immediately (``os._exit``: no traceback, no save; checkpoints already written stay readable because
orbax renames a step into place only when it is complete). Python runs signal handlers only in the
main thread between bytecodes, so a handler alone would wait for a long compile or step to return:
the signals are also written to a ``signal.set_wakeup_fd`` pipe by the C-level handler, and a daemon
thread reading that pipe acts on them at once. An ignored SIGINT (``nohup``) stays ignored.

``InterruptFlag`` (generation): ``with InterruptFlag() as flag: ... if flag(): stop`` between steps;
the first SIGINT only sets ``flag.set`` (nothing is raised inside a running jitted call), a second
prints ``message`` and ends the process with ``os._exit(130)``.

``exit_while_starting(prog)`` (every tool's start): while the heavy modules are imported, Ctrl-C ends the
process at once (exit 130, one line). ``import jax`` runs Python callbacks (its gc hook) that swallow a
KeyboardInterrupt, so an early Ctrl-C was lost (the run carried on) or broke the extension's start.

All install handlers only from the main thread and restore the previous ones when closed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from minimax_jax.exit_codes import INTERRUPTED as EXIT_INTERRUPTED

__all__ = ["EXIT_INTERRUPTED", "StopSignals", "InterruptFlag", "exit_while_starting"]

_FIRST = {signal.SIGINT: "interrupt: stopping after the current step with a checkpoint "
                         "(press Ctrl-C again to abort at once without saving)",
          signal.SIGTERM: "SIGTERM: stopping after the current step with a checkpoint"}


def _say(text: str) -> None:
    os.write(2, (text + "\n").encode())  # no Python stream lock: safe from the signal thread


class StopSignals:
    """Record the first SIGINT / SIGTERM; abort on a second SIGINT (see module docstring).

    Args:
      sigterm: handle SIGTERM (``checkpoint.save_on_sigterm``); SIGINT is always handled.
    """

    def __init__(self, *, sigterm: bool = True):
        self.signum: int | None = None
        self._prev: dict[int, object] = {}
        self._prev_fd = None
        self._pipe = None
        if threading.current_thread() is not threading.main_thread():
            return
        wanted = [signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else []
        wanted += [signal.SIGTERM] if sigterm else []
        if not wanted:
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._prev_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for s in wanted:
            self._prev[s] = signal.signal(s, self._ignore)
        threading.Thread(target=self._watch, args=(r,), name="train-stop-signals", daemon=True).start()

    @property
    def interrupted(self) -> bool:
        """True once SIGINT was the first stop signal."""
        return self.signum == signal.SIGINT

    def _ignore(self, signum, frame) -> None:
        """The Python-level handler: the watcher thread already acted on the signal."""

    def _watch(self, r: int) -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                os.close(r)
                return
            for signum in data:
                self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        if signum not in self._prev:
            return
        if self.signum is None:
            self.signum = signum
            _say(_FIRST[signum])
        elif signum == signal.SIGINT:
            _say("second interrupt: aborting now without saving (checkpoints already written are kept)")
            os._exit(EXIT_INTERRUPTED)

    def close(self) -> None:
        """Restore the previous handlers and wakeup fd (idempotent)."""
        for s, prev in self._prev.items():
            signal.signal(s, prev)
        self._prev = {}
        if self._pipe is not None:
            signal.set_wakeup_fd(self._prev_fd)
            os.close(self._pipe[1])  # the watcher reads EOF and closes its end
            self._pipe = None


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


@contextlib.contextmanager
def exit_while_starting(prog: str):
    """Inside, a SIGINT prints ``PROG: interrupted (Ctrl-C)`` and ends the process with status 130 at once
    (module docstring). Only over Python's default SIGINT handler, from the main thread."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def stop(signum, frame):
        _say(f"{prog}: interrupted (Ctrl-C)")
        os._exit(EXIT_INTERRUPTED)

    prev = signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
