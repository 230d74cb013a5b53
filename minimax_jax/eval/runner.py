"""Glue between the evaluation and the inference runtime (``minimax_jax.infer``).

The evaluation only needs two callables and a tokenizer:

- ``generate_fn(prompts: list[str], max_new_tokens: int) -> list[str]``: greedy (or configured)
  continuations, one string per prompt, WITHOUT the prompt text;
- ``logprob_fn(tokens: np.ndarray int32 [B, T]) -> np.ndarray float [B, T-1]``: natural-log
  probabilities of ``tokens[:, 1:]`` (see :mod:`minimax_jax.eval.perplexity`); may be None when the
  runtime cannot score, then perplexity is skipped;
- ``tokenizer``: a ``tokenizers.Tokenizer`` (lengths are measured in its tokens).

Contract with the runtime: ``minimax_jax.infer.make_eval_fns(checkpoint_dir: str, **options) -> Mapping``
(or a ``factory`` of the same signature passed to :func:`load_model_fns`) returns a mapping with keys ``"generate_fn"``,
``"logprob_fn"`` (callable or None) and ``"tokenizer"`` (a ``tokenizers.Tokenizer`` or a path to
``tokenizer.json`` / its directory). ``options`` are passed through from the CLI (``max_seq_len``;
``tokenizer_path`` when ``--tokenizer`` is given, so model and evaluation share one tokenizer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from minimax_jax.data.tokenizer import load_tokenizer
from minimax_jax.infer import make_eval_fns

FACTORY = "minimax_jax.infer.make_eval_fns"

GenerateFn = Callable[[list[str], int], list[str]]
LogprobFn = Callable[[np.ndarray], np.ndarray]


class RuntimeUnavailable(RuntimeError):
    """The inference runtime is missing or does not provide the evaluation interface."""


@dataclasses.dataclass(frozen=True)
class ModelFns:
    """The callables the evaluation uses (see module docstring)."""

    generate_fn: GenerateFn
    logprob_fn: LogprobFn | None
    tokenizer: object


def model_fns_from_mapping(m: Mapping, tokenizer_override: str | None = None) -> ModelFns:
    """Validates a runtime's ``make_eval_fns`` result and loads the tokenizer if given as a path.

    Raises:
      RuntimeUnavailable: naming the missing or non-callable entry.
    """
    if not isinstance(m, Mapping):
        raise RuntimeUnavailable(f"{FACTORY} must return a mapping, got {type(m).__name__}")
    gen = m.get("generate_fn")
    if not callable(gen):
        raise RuntimeUnavailable(f"{FACTORY} result has no callable 'generate_fn'")
    lp = m.get("logprob_fn")
    if lp is not None and not callable(lp):
        raise RuntimeUnavailable(f"{FACTORY} result: 'logprob_fn' is not callable")
    tok = tokenizer_override if tokenizer_override is not None else m.get("tokenizer")
    if tok is None:
        raise RuntimeUnavailable(
            f"{FACTORY} result has no 'tokenizer'; pass --tokenizer PATH"
        )
    if isinstance(tok, str):
        tok = load_tokenizer(tok)
    return ModelFns(gen, lp, tok)


def load_model_fns(checkpoint: str, *, tokenizer: str | None = None,
                   factory: Callable[..., Mapping] = make_eval_fns, **options) -> ModelFns:
    """Builds the evaluation callables for ``checkpoint`` with the inference runtime.

    Args:
      checkpoint: checkpoint directory, passed to ``factory``.
      tokenizer: optional ``tokenizer.json`` path (or directory) overriding the checkpoint's; it is
        forwarded to ``factory`` as ``tokenizer_path`` and used for length measurement.
      factory: ``minimax_jax.infer.make_eval_fns`` (another runtime of the same contract may be passed).
      options: forwarded to ``factory``.
    Raises:
      RuntimeUnavailable: when ``factory`` is not callable or returns something that breaks the contract
        (the message says what).
    """
    if not callable(factory):
        raise RuntimeUnavailable(
            f"factory {factory!r} is not a function(checkpoint_dir, **options) returning "
            "{'generate_fn', 'logprob_fn', 'tokenizer'}"
        )
    if tokenizer is not None:
        options = dict(options, tokenizer_path=tokenizer)
    return model_fns_from_mapping(factory(checkpoint, **options), tokenizer)
