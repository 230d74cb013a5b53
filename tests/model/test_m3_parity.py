"""MiniMax-M3 text model (MSA + MoE + dense layers) parity with HF ``MiniMaxM3VLForCausalLM``.

Sparsity really bites here: block sizes 8/16 with top-k 2-4 on sequences up to 400 tokens, so most
queries attend a strict subset of their history. Checked: logits (max relative error <= 1e-4 in
float32) and the selected block SETS of every MSA layer for every (group, query).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.convert.from_state import params_from_hf_state
from minimax_jax.model import forward
from tests import hf_fixtures as hf

jax.config.update("jax_default_matmul_precision", "highest")

F, S = "full_attention", "minimax_m3_sparse"
CASES = [
    # (fixture kwargs, sequence length)
    (dict(seed=0, block=8, topk_blocks=3), 64),
    (dict(seed=1, block=16, topk_blocks=2, layer_types=(F, S, S, S), mlp_types=("dense", "sparse", "sparse", "sparse")),
     400),
    (dict(seed=2, block=8, topk_blocks=4, layer_types=(S, F, S), mlp_types=("sparse", "sparse", "dense"), heads=8,
          kv=2, head_dim=8, rotary_dim=4, index_dim=8), 150),
    (dict(seed=3, block=16, topk_blocks=3, layer_types=(F, F, S), mlp_types=("dense", "dense", "sparse"), kv=1,
          heads=4, experts=6, top_k=3), 257),
]


def _hf_block_ids(model, tokens):
    import torch

    captured = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(
                lambda mod, args, out, i=i: captured.__setitem__(i, out.detach().numpy())))
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits.float().numpy()
    for h in hooks:
        h.remove()
    return logits, captured


@pytest.mark.parametrize("spec, seq_len", CASES, ids=lambda c: str(c) if isinstance(c, int) else f"seed{c['seed']}")
def test_logits_and_block_sets_match_hf(spec, seq_len):
    hf.require_hf()
    model = hf.m3_model(**spec)
    cfg = ModelConfig.from_hf_config(model.config.to_dict(), dtype="float32", param_dtype="float32",
                                     msa_impl="xla")
    assert cfg.has_msa and cfg.norm_kind == "gemma"
    params = params_from_hf_state(hf.state_of(model), cfg)
    tokens = np.random.default_rng(spec["seed"] + 10).integers(0, cfg.vocab_size, (1, seq_len)).astype(np.int32)
    ref_logits, ref_ids = _hf_block_ids(model, tokens)
    out = jax.jit(lambda p, t: forward(p, cfg, t, return_msa=True))(params, jnp.asarray(tokens))
    got = np.asarray(out.logits)
    rel = np.max(np.abs(got - ref_logits)) / np.max(np.abs(ref_logits))
    assert rel <= 1e-4, f"max relative error {rel:.3g}"
    assert sorted(ref_ids) == [int(m["layer"]) for m in out.aux["msa"]]
    sparse_rows = 0
    for m in out.aux["msa"]:
        ours = np.asarray(m["block_ids"])[0]          # [Hi, T, K]
        theirs = ref_ids[int(m["layer"])][0]               # [Hi, T, K'] (K' = min(K, NB))
        for r in range(ours.shape[0]):
            for t in range(seq_len):
                a = set(ours[r, t][ours[r, t] >= 0].tolist())
                b = set(theirs[r, t][theirs[r, t] >= 0].tolist())
                assert a == b, f"layer {m['layer']} group {r} query {t}: ours {sorted(a)} vs HF {sorted(b)}"
                assert t // cfg.index_block_size in a          # local block present
                sparse_rows += len(a) < t // cfg.index_block_size + 1
    assert sparse_rows > 0 or seq_len <= cfg.index_topk * cfg.index_block_size
