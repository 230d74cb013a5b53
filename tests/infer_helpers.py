"""Fixtures for the inference tests: tiny tokenizers, checkpoints on disk, a scripted "chain" model.

The chain model is a real checkpoint of our format whose decoder layers are all zero, so each
position's hidden state is its own token embedding; chain tokens get orthonormal embeddings and the
lm_head maps chain token j to chain token j + 1. Greedy decoding from a prompt that ends with the
first chain token therefore writes the chain: a model whose output we choose (a tool call, a
malformed tool call) while the whole pipeline (tokenizer, chat template, engine, stops, parsing) runs.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.chat import render_chat
from minimax_jax.config import ModelConfig
from minimax_jax.data.tokenizer import SPECIAL_TOKENS, save_tokenizer, special_token_ids, train_tokenizer
from minimax_jax.model import abstract_params

TRAIN_TEXT = ["The weather in Paris is mild. What is the weather like today? " * 4,
              "Let me check the forecast for the city and call a tool. " * 4]

CHAT = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]}

GOOD_PIECES = ["Let me check.", "</think>", "\n\n", "<minimax:tool_call>", '\n<invoke name="get_weather">\n',
               '<parameter name="city">Paris</parameter>\n</invoke>\n', "</minimax:tool_call>", "[e~["]
# The parameter is never closed: the parser must report it, not crash.
BAD_PIECES = ["Let me check.", "</think>", "\n\n", "<minimax:tool_call>", '\n<invoke name="get_weather">\n',
              '<parameter name="city">Paris\n</invoke>\n', "</minimax:tool_call>", "[e~["]


def tiny_tokenizer(extra: tuple[str, ...] = ()):
    """A 300-id byte-level BPE with the MiniMax special tokens (+ ``extra`` added tokens)."""
    tok = train_tokenizer(TRAIN_TEXT, 300)
    if extra:
        tok.add_tokens(sorted(set(extra)))
    return tok


def save_checkpoint(directory: str, cfg: ModelConfig, params, tokenizer=None) -> str:
    """Write our checkpoint layout (config.yaml + params/ orbax [+ tokenizer.json])."""
    import orbax.checkpoint as ocp

    from minimax_jax.convert.atomic_dir import PARAMS_DIR, write_config

    os.makedirs(directory, exist_ok=True)
    write_config(cfg, directory)
    with ocp.StandardCheckpointer() as ck:
        ck.save(os.path.join(os.path.abspath(directory), PARAMS_DIR), params)
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)
    return directory


def tiny_config(vocab: int, **kw) -> ModelConfig:
    """A one-layer dense M2-style float32 config (fast to compile)."""
    base = dict(vocab_size=vocab, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                rotary_dim=4, max_position_embeddings=2048, mlp_types=("dense",), dense_intermediate_size=8,
                dtype="float32", param_dtype="float32")
    base.update(kw)
    return ModelConfig(**base)


def chain_model(tokenizer, pieces, start_token: int, *, cycle: bool = False, mtp: int = 0, **cfg_kw):
    """(cfg, params) of a model whose greedy continuation after ``start_token`` is ``pieces`` (see module doc).

    ``cycle``: the last piece is followed by the first again (an endless loop). ``mtp``: add that many
    MTP modules that draft the chain exactly (embedding half of ``eh_proj`` = identity, zero layer),
    so speculative decoding accepts every draft.
    Raises AssertionError when the pieces do not map to distinct single tokens.
    """
    ids = [start_token]
    for p in pieces:
        enc = tokenizer.encode(p, add_special_tokens=False).ids
        assert len(enc) == 1, f"piece {p!r} is not one token: {enc}"
        ids.append(enc[0])
    assert len(set(ids)) == len(ids), f"chain tokens repeat: {ids}"
    special = special_token_ids(tokenizer)
    cfg = tiny_config(tokenizer.get_vocab_size(), bos_token_id=special["bos_token_id"],
                      eos_token_id=special["eos_token_id"], pad_token_id=special["pad_token_id"],
                      num_mtp_modules=mtp, **cfg_kw)
    assert len(ids) <= cfg.hidden_size
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_params(cfg))
    emb = 0.01 * np.random.default_rng(0).standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    head = np.zeros((cfg.hidden_size, cfg.vocab_size), np.float32)
    for j, t in enumerate(ids):
        emb[t] = np.eye(cfg.hidden_size, dtype=np.float32)[j]
        if j + 1 < len(ids):
            head[j, ids[j + 1]] = 10.0
    if cycle:
        head[len(ids) - 1, ids[1]] = 10.0
    params["embed"]["embedding"] = jnp.asarray(emb)
    params["lm_head"] = jnp.asarray(head)
    params["final_norm"]["scale"] = jnp.ones((cfg.hidden_size,), jnp.float32)
    h = cfg.hidden_size
    for mod in params.get("mtp", []):
        for name in ("enorm", "hnorm", "final_norm"):
            mod[name]["scale"] = np.ones((h,), np.float32)
        mod["eh_proj"] = np.concatenate([np.eye(h, dtype=np.float32), np.zeros((h, h), np.float32)], 0)
    return cfg, params


def chat_prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(render_chat(CHAT["messages"], CHAT["tools"]), add_special_tokens=False).ids


def chain_tokenizer(pieces):
    """Tiny tokenizer in which every piece is one token."""
    return tiny_tokenizer(tuple(p for p in pieces if p not in SPECIAL_TOKENS))


def chain_checkpoint(directory: str, pieces, **kw) -> str:
    """A chain-model checkpoint + tokenizer whose greedy reply to ``CHAT`` is ``"".join(pieces)``."""
    tok = chain_tokenizer(pieces)
    cfg, params = chain_model(tok, pieces, chat_prompt_ids(tok)[-1], **kw)
    return save_checkpoint(directory, cfg, params, tok)


def random_mtp(cfg: ModelConfig, seed: int, scale: float = 0.2) -> list:
    """Random MTP module params for ``cfg`` (float32 numpy; drafts will mostly be rejected)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: (scale * rng.standard_normal(a.shape)).astype(np.float32),
                        abstract_params(cfg)["mtp"])
