"""Evaluation: RULER-style synthetic long-context tasks, scoring, held-out perplexity, CLI.

Task generation and scoring need only a tokenizer; the model is reached through
:mod:`minimax_jax.eval.runner` (``generate_fn`` / ``logprob_fn``).
"""

from minimax_jax.data.haystack import Haystack, LengthError, char_counter, token_counter
from minimax_jax.data.tasks import TASKS, Example, completion, generate, generate_suite
from minimax_jax.eval.perplexity import heldout_perplexity, stream_perplexity
from minimax_jax.eval.scoring import score_examples, score_output

__all__ = [
    "Example", "Haystack", "LengthError", "TASKS", "char_counter", "completion", "generate",
    "generate_suite", "heldout_perplexity", "score_examples", "score_output", "stream_perplexity",
    "token_counter",
]
