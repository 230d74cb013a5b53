"""``python -m minimax_jax.serve`` (``minimax_jax.serve.cli``)."""

import sys

from minimax_jax.serve.cli import main

sys.exit(main())
