"""Tiny random HF transformers models used as numerical oracles (torch CPU, float32)."""

from __future__ import annotations

import numpy as np

try:  # the oracle is a test-only dependency
    import torch
    import transformers
except ImportError:  # pragma: no cover
    torch = transformers = None


def require_hf():
    import pytest

    if torch is None:
        pytest.skip("torch/transformers not installed (pip install -e .[test])")


def m2_model(seed: int, *, vocab=97, hidden=32, inter=16, layers=2, heads=6, kv=2, head_dim=8, rotary_dim=4,
             experts=5, top_k=3, native_rope=False):
    """A random ``MiniMaxM2ForCausalLM`` with a random (non-zero) correction bias."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, num_local_experts=experts,
              num_experts_per_tok=top_k, bos_token_id=1, eos_token_id=2)
    if native_rope:  # HF-native style: no rotary_dim, partial_rotary_factor in rope_parameters
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6,
                                 "partial_rotary_factor": rotary_dim / head_dim}
    else:
        kw["rotary_dim"] = rotary_dim
    cfg = transformers.MiniMaxM2Config(**kw)
    model = transformers.MiniMaxM2ForCausalLM(cfg).eval()
    _randomise(model, seed)
    return model


def m3_model(seed: int, *, vocab=97, hidden=32, inter=16, heads=4, kv=2, head_dim=16, rotary_dim=8, experts=5,
             top_k=2, dense_inter=24, shared_inter=12, index_dim=16, block=8, topk_blocks=3,
             layer_types=("full_attention", "minimax_m3_sparse", "minimax_m3_sparse"),
             mlp_types=("dense", "sparse", "sparse")):
    """A random ``MiniMaxM3VLForCausalLM`` text model. rope_parameters carries the partial factor
    explicitly: HF's M3 rotary embedding ignores ``rotary_dim`` without it (checked in 5.24)."""
    torch.manual_seed(seed)
    cfg = transformers.MiniMaxM3VLTextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=len(layer_types),
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, num_local_experts=experts,
        num_experts_per_tok=top_k, rotary_dim=rotary_dim, dense_intermediate_size=dense_inter,
        shared_intermediate_size=shared_inter, index_n_heads=kv, index_head_dim=index_dim,
        index_block_size=block, index_topk_blocks=topk_blocks, layer_types=list(layer_types),
        mlp_layer_types=list(mlp_types), bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": rotary_dim / head_dim})
    model = transformers.MiniMaxM3VLForCausalLM(cfg).eval()
    _randomise(model, seed)
    return model


def _randomise(model, seed):
    """Give norms and correction biases random values so their handling is really tested."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def state_of(model) -> dict[str, np.ndarray]:
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    return sd


def hf_logits(model, tokens: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kw = {}
        if attention_mask is not None:
            kw["attention_mask"] = torch.tensor(attention_mask)
        return model(torch.tensor(tokens), **kw).logits.float().numpy()
