"""M3 model features: MTP heads, MSA on an M2 model, sliding windows, gradient isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from minimax_jax.config import load_config
from minimax_jax.model import add_index_params, forward, init_params, mtp_forward
from minimax_jax.model.params import abstract_params

jax.config.update("jax_default_matmul_precision", "highest")


def test_mtp_heads_shapes_and_causality():
    cfg = load_config("tiny-m3")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 40), 0, cfg.vocab_size)
    fn = jax.jit(lambda p, t: mtp_forward(p, cfg, forward(p, cfg, t, return_hidden=True).hidden, t))
    outs = fn(params, tokens)
    assert len(outs) == cfg.num_mtp_modules and outs[0].shape == (1, 40, cfg.vocab_size)
    # Depth d at position t sees tokens up to t + d: changing token 30 changes depth-1 logits at
    # positions >= 29 and depth-2 logits at >= 28, never earlier ones.
    changed = fn(params, tokens.at[0, 30].set((tokens[0, 30] + 1) % cfg.vocab_size))
    for d, (a, b) in enumerate(zip(outs, changed), start=1):
        diff = np.abs(np.asarray(a - b)).max(-1)[0]
        assert np.all(diff[:30 - d] == 0), d
        assert diff[30 - d] > 0, d


def test_msa_on_m2_equals_dense_when_context_fits():
    cfg = load_config("tiny-m2")
    params = init_params(cfg, jax.random.key(0))
    msa_cfg = cfg.with_msa("all_full", index_block_size=8, index_topk=3, index_head_dim=16)
    msa_params = add_index_params(params, cfg, msa_cfg, jax.random.key(1))
    assert "index_q_proj" in msa_params["segments"][0]["attn"]
    short = jax.random.randint(jax.random.key(2), (2, 24), 0, cfg.vocab_size)  # 24 <= K*B = 24
    fwd = jax.jit(lambda p, t, c: forward(p, c, t).logits, static_argnums=2)
    np.testing.assert_allclose(fwd(msa_params, short, msa_cfg), fwd(params, short, cfg), rtol=1e-5, atol=1e-5)
    long = jax.random.randint(jax.random.key(3), (1, 64), 0, cfg.vocab_size)
    a = fwd(msa_params, long, msa_cfg)
    b = fwd(params, long, cfg)
    np.testing.assert_allclose(a[:, :24], b[:, :24], rtol=1e-5, atol=1e-5)   # still within K*B
    assert float(jnp.abs(a[:, 40:] - b[:, 40:]).max()) > 1e-6               # sparsity bites later


def test_add_index_params_covers_mtp_modules():
    """A dense M3-style model with MTP (its module takes the last layer's kind) turned into MSA on
    the last layers: the converted tree has exactly the MSA config's structure and shapes, MTP
    included, and the backbone weights are kept."""
    cfg = load_config("tiny-m3")
    dense = cfg.replace(layer_types=("full",) * cfg.num_layers)
    assert dense.num_mtp_modules >= 1
    params = init_params(dense, jax.random.key(0))
    msa_cfg = dense.with_msa([cfg.num_layers - 1])
    out = add_index_params(params, dense, msa_cfg, jax.random.key(1))
    want = abstract_params(msa_cfg)
    assert jax.tree.structure(out) == jax.tree.structure(want)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), out) == jax.tree.map(lambda a: (a.shape, a.dtype), want)
    assert "index_q_proj" in out["mtp"][0]["layer"]["attn"]
    np.testing.assert_array_equal(out["mtp"][0]["layer"]["attn"]["q_proj"], params["mtp"][0]["layer"]["attn"]["q_proj"])
    back = add_index_params(out, msa_cfg, dense, jax.random.key(2))     # and back to dense
    assert jax.tree.structure(back) == jax.tree.structure(params)


def test_sliding_window_layer():
    base = load_config("tiny-m2")
    params = init_params(base, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 30), 0, base.vocab_size)
    wide = base.replace(layer_types=("sliding",) * 3, sliding_window=64)
    narrow = base.replace(layer_types=("sliding",) * 3, sliding_window=4)
    fwd = jax.jit(lambda p, t, c: forward(p, c, t).logits, static_argnums=2)
    full = fwd(params, tokens, base)
    np.testing.assert_allclose(fwd(params, tokens, wide), full, rtol=1e-5, atol=1e-5)
    n = fwd(params, tokens, narrow)
    np.testing.assert_allclose(n[:, :4], full[:, :4], rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(n[:, 10:] - full[:, 10:]).max()) > 1e-6


def test_lm_loss_gives_zero_gradient_to_index_branch_and_kl_only_to_it():
    cfg = load_config("tiny-m3")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 48), 0, cfg.vocab_size)

    def lm_loss(p):
        logits = forward(p, cfg, tokens).logits[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def kl_loss(p, mode):
        aux = forward(p, cfg, tokens, indexer_kl=mode).aux
        return aux["indexer_kl_sum"] / aux["indexer_kl_count"]

    # one compiled program for the three gradients (they share the forward), checked in numpy
    g, *gks = jax.jit(lambda p: (jax.grad(lm_loss)(p),) + tuple(jax.grad(kl_loss)(p, m) for m in ("sparse", "dense"))
                      )(params)
    seg = g["segments"][1]["attn"]
    for name in ("index_q_proj", "index_k_proj"):
        assert float(np.abs(seg[name]).max()) == 0.0, name
    assert float(np.abs(seg["q_proj"]).max()) > 0
    for mode, gk in zip(("sparse", "dense"), gks):
        flat = jax.tree_util.tree_flatten_with_path(gk)[0]
        for path, leaf in flat:
            name = jax.tree_util.keystr(path)
            nonzero = float(np.abs(np.asarray(leaf)).max()) > 0
            if "index_" in name:
                continue
            assert not nonzero, f"KL ({mode}) reached {name}"
        assert float(np.abs(gk["segments"][1]["attn"]["index_q_proj"]).max()) > 0
