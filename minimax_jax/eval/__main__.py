"""``python -m minimax_jax.eval``: see :mod:`minimax_jax.eval.cli`."""

import sys

from minimax_jax.eval.cli import main

sys.exit(main())
