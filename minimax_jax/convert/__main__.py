"""``python -m minimax_jax.convert``: see ``minimax_jax.convert.cli``."""

import sys

from minimax_jax.interrupt import exit_while_starting

with exit_while_starting("python -m minimax_jax.convert"):
    import jax  # noqa: F401  (the slow import a Ctrl-C must not be lost in)
    from minimax_jax.convert.cli import main

sys.exit(main())
