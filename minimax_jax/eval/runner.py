"""Glue between the evaluation and the inference runtime (``minimax_jax.infer``).

The evaluation only needs two callables and a tokenizer:

- ``generate_fn(prompts: list[str], max_new_tokens: int) -> list[str]``: greedy (or configured)
  continuations, one string per prompt, WITHOUT the prompt text;
- ``logprob_fn(tokens: np.ndarray int32 [B, T]) -> np.ndarray float [B, T-1]``: natural-log
  probabilities of ``tokens[:, 1:]`` (see :mod:`minimax_jax.eval.perplexity`); may be None when the
  runtime cannot score, then perplexity is skipped;
- ``tokenizer``: a ``tokenizers.Tokenizer`` (lengths are measured in its tokens).

Contract with the runtime: ``minimax_jax.infer`` provides
``make_eval_fns(checkpoint_dir: str, **options) -> Mapping`` with keys ``"generate_fn"``,
``"logprob_fn"`` (callable or None) and ``"tokenizer"`` (a ``tokenizers.Tokenizer`` or a path to
``tokenizer.json`` / its directory). ``options`` are passed through from the CLI (``max_seq_len``;
``tokenizer_path`` when ``--tokenizer`` is given, so model and evaluation share one tokenizer).
The module is imported only when :func:`load_model_fns` is called.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping

import numpy as np

from minimax_jax.data.tokenizer import load_tokenizer

INFER_MODULE = "minimax_jax.infer"
FACTORY = "make_eval_fns"

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
        raise RuntimeUnavailable(f"{INFER_MODULE}.{FACTORY} must return a mapping, got {type(m).__name__}")
    gen = m.get("generate_fn")
    if not callable(gen):
        raise RuntimeUnavailable(f"{INFER_MODULE}.{FACTORY} result has no callable 'generate_fn'")
    lp = m.get("logprob_fn")
    if lp is not None and not callable(lp):
        raise RuntimeUnavailable(f"{INFER_MODULE}.{FACTORY} result: 'logprob_fn' is not callable")
    tok = tokenizer_override if tokenizer_override is not None else m.get("tokenizer")
    if tok is None:
        raise RuntimeUnavailable(
            f"{INFER_MODULE}.{FACTORY} result has no 'tokenizer'; pass --tokenizer PATH"
        )
    if isinstance(tok, str):
        tok = load_tokenizer(tok)
    return ModelFns(gen, lp, tok)


def load_model_fns(checkpoint: str, *, tokenizer: str | None = None, **options) -> ModelFns:
    """Imports ``minimax_jax.infer`` and builds the evaluation callables for ``checkpoint``.

    Args:
      checkpoint: checkpoint directory, passed to ``make_eval_fns``.
      tokenizer: optional ``tokenizer.json`` path (or directory) overriding the checkpoint's; it is
        forwarded to ``make_eval_fns`` as ``tokenizer_path`` and used for length measurement.
      options: forwarded to ``make_eval_fns``.
    Raises:
      RuntimeUnavailable: when ``minimax_jax.infer`` is not installed / importable or lacks
        ``make_eval_fns`` (the message says which).
    """
    try:
        infer = importlib.import_module(INFER_MODULE)
    except ModuleNotFoundError as e:
        if e.name and INFER_MODULE.startswith(e.name):
            raise RuntimeUnavailable(
                f"the inference runtime {INFER_MODULE!r} is not available in this installation; "
                "the eval CLI needs it to run a checkpoint (task generation and scoring work without it)"
            ) from e
        raise
    factory = getattr(infer, FACTORY, None)
    if not callable(factory):
        raise RuntimeUnavailable(
            f"{INFER_MODULE} has no function {FACTORY}(checkpoint_dir, **options) returning "
            "{'generate_fn', 'logprob_fn', 'tokenizer'}"
        )
    if tokenizer is not None:
        options = dict(options, tokenizer_path=tokenizer)
    return model_fns_from_mapping(factory(checkpoint, **options), tokenizer)
