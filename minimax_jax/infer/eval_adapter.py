"""Callables for the evaluation module (``minimax_jax.eval.runner``).

* ``make_generate_fn(checkpoint_dir | LoadedModel, ...) -> generate_fn(prompts: list[str],
  max_new_tokens: int) -> list[str]``: continuations WITHOUT the prompt, greedy by default, stopping
  at the end-of-turn token; runs on the paged engine unless ``engine="recompute"``.
* ``make_logprob_fn(...) -> logprob_fn(tokens int32 [B, T]) -> float32 [B, T-1]``: natural-log
  probability of ``tokens[:, 1:]`` from one full forward pass (scoring needs every position's
  logits, which is what ``forward`` computes; the decode engine is for generation).
* ``make_eval_fns(checkpoint_dir, **options)``: the mapping the eval runner imports.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.infer.generation import GenerationConfig, Generator
from minimax_jax.infer.loading import LoadedModel, load_model
from minimax_jax.infer.sampler import SamplingParams

__all__ = ["make_eval_fns", "make_generate_fn", "make_logprob_fn"]


def _model(model_or_dir: Any, **load_kw) -> LoadedModel:
    return model_or_dir if isinstance(model_or_dir, LoadedModel) else load_model(model_or_dir, **load_kw)


def make_generate_fn(model_or_dir, *, engine: str = "paged", sampling: SamplingParams = SamplingParams(),
                     speculative: str | None = None, batch_size: int = 8, log=None,
                     engine_options: dict | None = None, **load_kw):
    """Build ``generate_fn(prompts, max_new_tokens) -> list[str]`` (see module doc).

    ``batch_size`` prompts run together; ``engine_options`` go to the paged engine (e.g.
    ``prefill_chunk``); ``load_kw`` go to ``load_model`` when a directory is given.
    The returned function has ``.generator`` (for statistics) attached.
    """
    m = _model(model_or_dir, **load_kw)
    gen = Generator(m.cfg, m.params, m.tokenizer, engine=engine, engine_options=engine_options, log=log)

    def generate_fn(prompts: list[str], max_new_tokens: int) -> list[str]:
        config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, speculative=speculative)
        out = []
        for i in range(0, len(prompts), batch_size):
            res = gen.generate_text(list(prompts[i:i + batch_size]), config)
            out.extend(s.text for s in res.sequences)
        return out

    generate_fn.generator = gen
    return generate_fn


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def make_logprob_fn(model_or_dir, **load_kw):
    """Build ``logprob_fn(tokens [B, T]) -> [B, T-1]`` (see module doc). Lengths are padded to a power
    of two (padding is its own segment) so few shapes compile."""
    from minimax_jax.model.transformer import forward

    m = _model(model_or_dir, **load_kw)
    cfg = m.cfg

    @jax.jit
    def score(params, tokens, segs):
        logp = jax.nn.log_softmax(forward(params, cfg, tokens, segment_ids=segs).logits, axis=-1)
        return jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]

    def logprob_fn(tokens) -> np.ndarray:
        tokens = np.asarray(tokens, np.int32)
        if tokens.ndim != 2 or tokens.shape[1] < 2:
            raise ValueError(f"tokens must be [B, T] with T >= 2, got shape {tokens.shape}")
        if tokens.shape[1] > cfg.max_position_embeddings:
            raise ValueError(f"{tokens.shape[1]} tokens exceed the model's context {cfg.max_position_embeddings}")
        b, t = tokens.shape
        tp = _bucket(t)
        padded = np.zeros((b, tp), np.int32)
        padded[:, :t] = tokens
        segs = np.ones((b, tp), np.int32)
        segs[:, :t] = 0
        return np.asarray(score(m.params, jnp.asarray(padded), jnp.asarray(segs)))[:, :t - 1]

    return logprob_fn


def make_eval_fns(checkpoint_dir: str, *, max_seq_len: int | None = None, engine: str = "paged",
                  prefill_chunk: int | None = None, **load_kw) -> dict:
    """``{"generate_fn", "logprob_fn", "tokenizer"}`` for ``minimax_jax.eval.runner``; the checkpoint
    is loaded once. ``max_seq_len`` (from the eval CLI) is checked against the model's context;
    ``prefill_chunk`` (prompt tokens per prefill step of the paged engine) defaults to the engine's."""
    m = load_model(checkpoint_dir, **load_kw)
    if max_seq_len is not None and max_seq_len > m.cfg.max_position_embeddings:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's context {m.cfg.max_position_embeddings}")
    opts = None if prefill_chunk is None else {"prefill_chunk": int(prefill_chunk)}
    return {"generate_fn": make_generate_fn(m, engine=engine, engine_options=opts), "logprob_fn": make_logprob_fn(m),
            "tokenizer": m.tokenizer}
