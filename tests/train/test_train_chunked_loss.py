"""Chunked lm head + cross-entropy (``run.logits_chunk``): same loss and gradients as the whole-logits
path, one slice of logits in memory at a time, and the train step wired to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.model import init_params
from minimax_jax.train.config import TrainConfigError, from_dict
from minimax_jax.train.data import SyntheticIterator
from minimax_jax.train.losses import chunked_cross_entropy_sums, cross_entropy_sums, mtp_weights_list
from minimax_jax.train.model_init import model_configs
from minimax_jax.train.optimizer import PHASE_MAIN, make_optimizer
from minimax_jax.train.step import StepSpec, init_state, make_eval_step, make_train_step
from tests.train_helpers import MICRO_MSA_MODEL, micro_train_dict


def _full(h, w, t, m):
    return cross_entropy_sums(jnp.einsum("bth,hv->btv", h, w, preferred_element_type=jnp.float32), t, m)


@pytest.mark.parametrize("t,chunk", [(37, 8), (32, 32), (5, 16)])
def test_chunked_equals_whole_logits_values_and_grads(t, chunk):
    ks = jax.random.split(jax.random.key(t * 100 + chunk), 4)
    b, h, v = 2, 16, 97
    x = jax.random.normal(ks[0], (b, t, h), jnp.float32)
    w = 0.5 * jax.random.normal(ks[1], (h, v), jnp.float32)
    tgt = jax.random.randint(ks[2], (b, t), 0, v)
    mask = (jax.random.uniform(ks[3], (b, t)) > 0.3).astype(jnp.float32)

    def total(fn):
        return lambda x, w: (lambda c: c[0] + 0.1 * c[1])(fn(x, w))

    full = total(lambda x, w: _full(x, w, tgt, mask))
    chunked = total(lambda x, w: chunked_cross_entropy_sums(x, w, tgt, mask, chunk))
    sums = jax.jit(lambda x, w: (_full(x, w, tgt, mask), chunked_cross_entropy_sums(x, w, tgt, mask, chunk)))
    np.testing.assert_allclose(*(np.asarray(s) for s in sums(x, w)), rtol=1e-5)
    (vf, gf), (vc, gc) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w) for f in (full, chunked))
    np.testing.assert_allclose(vc, vf, rtol=1e-5)
    for a, b_ in zip(gc, gf):
        assert np.abs(np.asarray(b_)).max() > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-5, atol=1e-6)


def test_chunked_loss_bad_arguments():
    x, w = jnp.zeros((1, 4, 8)), jnp.zeros((8, 11))
    t, m = jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4))
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunked_cross_entropy_sums(x, w, t, m, 0)
    with pytest.raises(ValueError, match="do not match"):
        chunked_cross_entropy_sums(x, jnp.zeros((9, 11)), t, m, 2)


def test_chunked_loss_holds_one_slice_of_logits():
    """XLA's buffer plan of value_and_grad: whole logits need >= T*V*4 bytes of temporaries, the
    chunked loss about two slices (a slice's logits and their gradient; 36 MB here vs 134 MB)."""
    b, t, h, v, chunk = 1, 2048, 32, 16384, 256
    x = jax.ShapeDtypeStruct((b, t, h), jnp.float32)
    w = jax.ShapeDtypeStruct((h, v), jnp.float32)
    tgt = jax.ShapeDtypeStruct((b, t), jnp.int32)
    mask = jax.ShapeDtypeStruct((b, t), jnp.float32)

    def temp_bytes(fn):
        g = jax.jit(jax.value_and_grad(lambda x, w, t, m: fn(x, w, t, m)[0], argnums=(0, 1)))
        return g.lower(x, w, tgt, mask).compile().memory_analysis().temp_size_in_bytes

    whole = temp_bytes(_full)
    sliced = temp_bytes(lambda x, w, t, m: chunked_cross_entropy_sums(x, w, t, m, chunk))
    logits_bytes, slice_bytes = b * t * v * 4, b * chunk * v * 4
    assert whole >= logits_bytes, (whole, logits_bytes)
    assert sliced <= 3 * slice_bytes < logits_bytes / 2, (sliced, slice_bytes)   # logits + their grad


def _step_setup(tmp_path, chunk):
    tc = from_dict(micro_train_dict(str(tmp_path), model=MICRO_MSA_MODEL,
                                    data={"kind": "synthetic", "seq_len": 48, "batch_size": 4},
                                    optim={"mtp_weights": 0.5, "z_loss": 1e-3},
                                    run={"logits_chunk": chunk}))
    assert tc.run.logits_chunk == chunk
    cfg, _ = model_configs(tc)
    params = init_params(cfg, jax.random.key(0))
    tx, trainable, sched = make_optimizer(tc, params, PHASE_MAIN)
    spec = StepSpec(cfg=cfg, kl_mode="sparse", z_loss=1e-3, mtp_weights=mtp_weights_list(0.5, cfg.num_mtp_modules),
                    logits_chunk=tc.run.logits_chunk)
    step = jax.jit(make_train_step(spec, tx, trainable, sched))
    batch = next(SyntheticIterator(48, 4, cfg.vocab_size, seed=5, mean_doc_len=20))
    return cfg, params, init_state(params, tx, 0), step, batch


def test_train_step_with_logits_chunk_equals_whole_logits(tmp_path):
    cfg, params, s0, step0, batch = _step_setup(tmp_path / "a", 0)
    _, _, s0c, step_c, _ = _step_setup(tmp_path / "b", 13)
    sa, ma = step0(s0, batch)
    sb, mb = step_c(s0c, batch)
    for key in ("loss", "lm_loss", "z_loss", "mtp_loss/1", "grad_norm"):
        np.testing.assert_allclose(mb[key], ma[key], rtol=2e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(sa["params"]), jax.tree.leaves(sb["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    ev = {k: jnp.asarray(v) for k, v in batch.items()}
    e0, n0 = jax.jit(make_eval_step(cfg))(params, ev)
    e1, n1 = jax.jit(make_eval_step(cfg, 13))(params, ev)
    np.testing.assert_allclose(e1, e0, rtol=1e-5)
    assert float(n0) == float(n1) > 0


def test_logits_chunk_config_is_validated(tmp_path):
    with pytest.raises(TrainConfigError, match="run.logits_chunk"):
        from_dict(micro_train_dict(str(tmp_path), run={"logits_chunk": -4}))
