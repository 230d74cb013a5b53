"""``python -m minimax_jax.convert``: see ``minimax_jax.convert.cli``."""

import sys

from minimax_jax.convert.cli import main

sys.exit(main())
