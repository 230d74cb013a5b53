"""Tied input embedding and output head (``tie_word_embeddings``, the demo config since session 6):
no ``lm_head`` parameter, logits equal an untied model whose head is the embedding's transpose, the
head's gradient reaches the embedding, and checkpoints (ours and HF safetensors) round-trip."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.convert import load_checkpoint
from minimax_jax.convert.export import export_orbax_to_hf
from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
from minimax_jax.convert.save import save_checkpoint
from minimax_jax.model import forward, init_params
from minimax_jax.model.transformer import mtp_forward


def _cfgs():
    untied = ModelConfig.from_yaml("configs/tiny-m3.yaml").replace(dtype="float32", msa_impl="xla")
    return untied.replace(tie_word_embeddings=True), untied


def test_tied_logits_equal_untied_with_transposed_embedding():
    tied, untied = _cfgs()
    p = init_params(tied, jax.random.key(0))
    assert "lm_head" not in p
    q = dict(p, lm_head=p["embed"]["embedding"].T)
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 3, tied.vocab_size)

    def loss(params, cfg):
        return jnp.mean(jax.nn.logsumexp(forward(params, cfg, tokens).logits, -1))

    @functools.partial(jax.jit, static_argnums=1)     # one compile per config, not one per op
    def outputs(params, cfg):
        out = forward(params, cfg, tokens, return_hidden=True)
        return out.logits, mtp_forward(params, cfg, out.hidden, tokens), jax.grad(loss)(params, cfg)

    a_logits, a_mtp, g_tied = outputs(p, tied)
    b_logits, b_mtp, g_untied = outputs(q, untied)
    np.testing.assert_allclose(a_logits, b_logits, rtol=1e-5, atol=1e-5)
    for x, y in zip(a_mtp, b_mtp):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)

    # d loss / d embedding (tied) == d/d embedding + (d/d lm_head)^T (untied)
    g_tied = g_tied["embed"]["embedding"]
    np.testing.assert_allclose(g_tied, g_untied["embed"]["embedding"] + g_untied["lm_head"].T, rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(g_untied["lm_head"]).max()) > 0


def test_tied_checkpoint_roundtrips_through_orbax_and_hf(tmp_path):
    tied, _ = _cfgs()
    p = init_params(tied, jax.random.key(2))
    save_checkpoint(p, tied, str(tmp_path / "ours"), dtype="float32")
    cfg, back = load_checkpoint(tmp_path / "ours")
    assert cfg.tie_word_embeddings and "lm_head" not in back
    export_orbax_to_hf(str(tmp_path / "ours"), str(tmp_path / "hf"), progress=False)
    cfg2, _ = convert_hf_to_orbax(str(tmp_path / "hf"), str(tmp_path / "again"), "float32", progress=False)
    assert cfg2.tie_word_embeddings
    _, again = load_checkpoint(tmp_path / "again")
    flat = lambda t: {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}
    a, b = flat(back), flat(again)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
