"""``run(main)``: ``absl.app.run`` for the project's CLIs, with ``--help`` exiting 0.

absl's help flags (``--help``, ``-h``, ``-?``, ``--helpshort``, ``--helpfull``, ``--helpxml``) print the
usage and then exit with status 1, which scripts and CI read as a failure; asking for help is not an
error, so a help request that ends with status 1 ends with 0 instead. Every other exit status
(flag errors included) is kept.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from absl import app

HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "-helpshort", "--helpfull", "-helpfull",
              "--helpxml", "-helpxml")


def run(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> None:
    """Run ``main`` through ``absl.app.run`` (argv default ``sys.argv``); raises SystemExit."""
    argv = list(sys.argv if argv is None else argv)
    try:
        app.run(main, argv=argv)
    except SystemExit as e:
        if e.code == 1 and any(a in HELP_FLAGS for a in argv[1:]):
            raise SystemExit(0) from None
        raise
