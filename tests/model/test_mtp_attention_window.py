"""``mtp_attention_window``: the MTP modules attend over a sliding window of their last W tokens, in training
(``mtp_forward``) and in drafting (``mtp_depth``) alike, so a drafting window of >= depth * (W - 1) + 1 tokens
reproduces the trained computation exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import ConfigError, load_config
from minimax_jax.decode.spec_loop import mtp_depth, stack_mtp
from minimax_jax.model import forward, init_params, mtp_forward
from minimax_jax.model.params import mtp_compute_kinds

jax.config.update("jax_default_matmul_precision", "highest")
W, T = 4, 24


@pytest.fixture(scope="module")
def model():
    cfg = load_config("tiny-m3").replace(num_mtp_modules=2, dtype="float32", param_dtype="float32",
                                         mtp_attention_window=W)
    params = init_params(cfg, jax.random.PRNGKey(3))
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (1, T)), jnp.int32)
    hidden = jax.jit(lambda p, t: forward(p, cfg, t, return_hidden=True).hidden)(params, tokens)   # one compile
    return cfg, params, tokens, hidden


def test_the_window_runs_a_sliding_layer_over_the_same_weights(model):
    cfg = model[0]
    lcfg, lt, _ = mtp_compute_kinds(cfg)
    assert (lt, lcfg.sliding_window) == ("sliding", W)
    assert mtp_compute_kinds(cfg.replace(mtp_attention_window=None))[1] == cfg.layer_types[-1]


@pytest.mark.parametrize("depth", [1, 2])
def test_depth_d_sees_exactly_its_last_d_windows(model, depth):
    """Depth d at the last position depends on the last d * (W - 1) + 1 positions only: recomputed from just
    those (positions kept), its logits are equal; without the window (the layer's own attention over all
    positions) they differ."""
    cfg, params, tokens, hidden = model
    mtp = jax.jit(mtp_forward, static_argnums=1)     # one compile per call, not the model's ops one by one
    d = depth
    keep = d * (W - 1) + 1
    n = T - d                     # the last position with a real shifted token
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    full = mtp(params, cfg, hidden[:, :n + d], tokens[:, :n + d], positions=pos[:, :n + d])[d - 1]
    a = n - keep
    cut = mtp(params, cfg, hidden[:, a:n + d], tokens[:, a:n + d], positions=pos[:, a:n + d])[d - 1]
    np.testing.assert_allclose(np.asarray(cut[0, keep - 1]), np.asarray(full[0, n - 1]), rtol=1e-5, atol=1e-5)
    own = mtp(params, cfg.replace(mtp_attention_window=None), hidden[:, :n + d], tokens[:, :n + d],
              positions=pos[:, :n + d])[d - 1]
    assert np.max(np.abs(np.asarray(own[0, n - 1]) - np.asarray(full[0, n - 1]))) > 1e-4


def test_drafting_depths_equal_the_trained_computation(model):
    """``mtp_depth`` (the drafter's and the device loop's form) computes what ``mtp_forward`` trains."""
    cfg, params, tokens, hidden = model
    ref = jax.jit(mtp_forward, static_argnums=1)(params, cfg, hidden, tokens)
    depth = jax.jit(lambda d, h, nxt, pos, seg: mtp_depth(params, cfg, d, h, nxt, pos, seg, mtp=stack_mtp(params)))
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    seg = jnp.zeros((1, T), jnp.int32)
    h = hidden
    for d in range(1, cfg.num_mtp_modules + 1):
        nxt = jnp.pad(tokens[:, d:], ((0, 0), (0, d)))
        h, logits = depth(jnp.int32(d), h, nxt, pos, seg)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(ref[d - 1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_bad_window_is_refused(bad):
    with pytest.raises(ConfigError, match="mtp_attention_window"):
        load_config("tiny-m3").replace(mtp_attention_window=bad)


def test_the_window_survives_the_hf_config_round_trip():
    from minimax_jax.config import ModelConfig
    cfg = load_config("tiny-m3").replace(num_mtp_modules=1, mtp_attention_window=16)
    hf_cfg = cfg.to_hf_config()
    assert hf_cfg["mtp_attention_window"] == 16
    assert ModelConfig.from_hf_config(hf_cfg).mtp_attention_window == 16
    assert "mtp_attention_window" not in cfg.replace(mtp_attention_window=None).to_hf_config()
