"""Inference runtime: load a checkpoint, generate (paged decode engine, sampling, stops, streaming,
MTP speculative decoding), report statistics; adapters for the evaluation module.

Modules (one job each): ``loading`` (checkpoint + tokenizer, HF on-the-fly conversion, mismatch
report), ``attention_mode`` (``--attention dense``: MSA layers run as full attention), ``backends``
(paged engine / recompute oracle behind one interface), ``sampler`` (seeded
per-row choice), ``drafter`` (MTP drafts), ``speculative`` (acceptance rule), ``generation`` (the
loop), ``metrics``, ``eval_adapter``, ``cli`` (``python infer.py``).
"""

from minimax_jax.infer.errors import (CheckpointMismatch, CheckpointNotFound, ContextTooLong, EngineUnavailable,
                                      InferenceError, TokenizerNotFound)
from minimax_jax.infer.eval_adapter import make_eval_fns, make_generate_fn, make_logprob_fn
from minimax_jax.infer.generation import GenerationConfig, GenerationOutput, Generator, SequenceResult
from minimax_jax.infer.loading import DEFAULT_CHECKPOINT, LoadedModel, load_model
from minimax_jax.infer.metrics import GenerationStats
from minimax_jax.infer.sampler import SamplingParams

__all__ = ["CheckpointMismatch", "CheckpointNotFound", "ContextTooLong", "DEFAULT_CHECKPOINT", "EngineUnavailable",
           "GenerationConfig", "GenerationOutput", "GenerationStats", "Generator", "InferenceError", "LoadedModel",
           "SamplingParams", "SequenceResult", "TokenizerNotFound", "generate", "load_model", "make_eval_fns",
           "make_generate_fn", "make_logprob_fn"]


def generate(prompts, cfg, params, *, tokenizer=None, engine: str = "paged", **config_kw):
    """One-shot convenience for ``prompts: list[list[int]]`` (any lengths): ``Generator(cfg, params,
    tokenizer, engine=engine).generate(prompts, GenerationConfig(**config_kw))``. Returns a
    GenerationOutput. Reuse a ``Generator`` for several calls (it keeps the compiled engine)."""
    return Generator(cfg, params, tokenizer, engine=engine).generate(prompts, GenerationConfig(**config_kw))
