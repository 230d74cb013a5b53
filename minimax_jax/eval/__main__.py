"""``python -m minimax_jax.eval``: see :mod:`minimax_jax.eval.cli`."""

import sys

from minimax_jax.interrupt import exit_while_starting

with exit_while_starting("python -m minimax_jax.eval"):
    import jax  # noqa: F401  (the slow import a Ctrl-C must not be lost in)
    from minimax_jax.eval.cli import main

sys.exit(main())
