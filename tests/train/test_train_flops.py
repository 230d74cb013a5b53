"""FLOP counting of minimax_jax.train.metrics: the parts (model / indexer / KL) against a hand count."""

import numpy as np

from minimax_jax.config import load_config
from minimax_jax.train.metrics import matmul_params_per_token, train_flops, train_flops_parts


def test_parts_match_a_hand_count_on_tiny_m3():
    cfg = load_config("configs/tiny-m3.yaml")
    assert "msa" in cfg.layer_types
    t = 3 * cfg.index_topk * cfg.index_block_size              # past the sparse context
    pos = np.arange(t)[None]
    pos1 = pos + 1.0
    kinds = list(cfg.layer_types) + [cfg.layer_types[-1]] * cfg.num_mtp_modules
    n_msa = kinds.count("msa")
    hd, hdi = cfg.num_heads * cfg.head_dim, cfg.index_num_heads * cfg.index_head_dim
    sparse = np.minimum(pos1, cfg.index_topk * cfg.index_block_size).sum()
    want_index = n_msa * 2.0 * hdi * pos1.sum()              # forward only: the selection has no gradient
    want_kl = n_msa * (2.0 * hd + 6.0 * hdi) * sparse
    parts = train_flops_parts(cfg, pos)
    np.testing.assert_allclose(parts["indexer"], want_index, rtol=1e-12)
    np.testing.assert_allclose(parts["kl"], want_kl, rtol=1e-12)
    assert parts["model"] > 6.0 * matmul_params_per_token(cfg) * t       # + attention
    assert train_flops(cfg, pos) == parts["model"] + parts["indexer"]
