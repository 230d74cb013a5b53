"""The train step: gradient accumulation == one large batch, freezing, the router-bias rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.model import forward, init_params
from minimax_jax.ops.moe import update_router_bias
from minimax_jax.train.config import from_dict
from minimax_jax.train.data import SyntheticIterator
from minimax_jax.train.losses import mtp_weights_list
from minimax_jax.train.model_init import model_configs
from minimax_jax.train.optimizer import PHASE_MAIN, PHASE_WARMUP, held_router_biases, leaf_paths, make_optimizer
from minimax_jax.train.step import StepSpec, init_state, make_train_step
from tests.train_helpers import MICRO_MSA_MODEL, micro_train_dict

FREEZE = "segments/0/attn/(q|k)_proj"


def _setup(tmp_path, accum, phase=PHASE_MAIN, **msa):
    tc = from_dict(micro_train_dict(str(tmp_path), model=MICRO_MSA_MODEL,
                                    data={"kind": "synthetic", "seq_len": 48, "batch_size": 4},
                                    optim={"grad_accum": accum, "freeze": [FREEZE], "router_bias_rate": 0.01,
                                           "mtp_weights": 0.5, "z_loss": 1e-3},
                                    msa={"kl_coeff": 0.7, "indexer_warmup_steps": 2, **msa}))
    cfg, _ = model_configs(tc)
    params = init_params(cfg, jax.random.key(0))
    tx, trainable, sched = make_optimizer(tc, params, phase)
    spec = StepSpec(cfg=cfg, kl_mode="dense" if phase == PHASE_WARMUP else "sparse", kl_coeff=0.7, z_loss=1e-3,
                    mtp_weights=mtp_weights_list(0.5, cfg.num_mtp_modules), grad_accum=accum,
                    router_bias_rate=0.01)
    step = jax.jit(make_train_step(spec, tx, trainable, sched))
    batch = next(SyntheticIterator(48, 4, cfg.vocab_size, seed=3, mean_doc_len=20))
    return cfg, params, init_state(params, tx, 0), step, batch


@pytest.fixture(scope="module")
def one_and_two(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("acc")
    out = {}
    for accum in (1, 2):
        cfg, params, state, step, batch = _setup(tmp, accum)
        state1, m1 = step(state, batch)
        state2, m2 = step(state1, batch)
        out[accum] = (cfg, params, state1, m1, state2, m2, batch)
    return out


def test_grad_accumulation_equals_large_batch(one_and_two):
    _, _, s1a, m1a, s2a, m2a, _ = one_and_two[1]
    _, _, s1b, m1b, s2b, m2b, _ = one_and_two[2]
    for key in ("loss", "lm_loss", "mtp_loss/1", "indexer_kl", "z_loss", "grad_norm"):
        np.testing.assert_allclose(m1a[key], m1b[key], rtol=2e-5, err_msg=key)
        np.testing.assert_allclose(m2a[key], m2b[key], rtol=2e-5, err_msg=key)
    for a, b, path in zip(jax.tree.leaves(s2a["params"]), jax.tree.leaves(s2b["params"]), leaf_paths(s2a["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=path)
    assert float(m1a["indexer_kl"]) > 0 and float(m1a["mtp_loss/1"]) > 0


def test_freeze_and_router_bias_rule(one_and_two):
    cfg, p0, s1, m1, s2, m2, batch = one_and_two[1]
    assert float(m1["lr"]) == 0.0 and float(m2["lr"]) > 0  # constant schedule, 2 warm-up steps
    paths = leaf_paths(p0)
    changed = {p: not np.array_equal(a, b) for p, a, b in zip(paths, jax.tree.leaves(p0),
                                                             jax.tree.leaves(s2["params"]))}
    assert not changed["segments/0/attn/q_proj"] and not changed["segments/0/attn/k_proj"]
    assert changed["segments/0/attn/v_proj"] and changed["segments/1/attn/index_q_proj"]
    assert changed["embed/embedding"] and changed["mtp/0/eh_proj"]
    # router_bias moved by exactly rate * sign(mean_load - load), with the load of the whole batch.
    out = jax.jit(lambda p, t, pos, seg: forward(p, cfg, t, positions=pos, segment_ids=seg))(
        p0, jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"]))
    load = out.aux["router_load"]
    want = update_router_bias(p0["segments"][1]["mlp"]["router_bias"], load, 0.01)
    np.testing.assert_allclose(s1["params"]["segments"][1]["mlp"]["router_bias"], want, atol=1e-7)
    assert np.abs(np.asarray(want)).max() > 0
    assert not changed["mtp/0/layer/mlp/router_bias"]


def test_frozen_router_bias_is_held(tmp_path):
    """A freeze regex that matches a layer's router_bias holds it against the balancing rule too."""
    tc = from_dict(micro_train_dict(str(tmp_path), model=MICRO_MSA_MODEL,
                                    data={"kind": "synthetic", "seq_len": 48, "batch_size": 4},
                                    optim={"freeze": ["^segments/1/mlp/"], "router_bias_rate": 0.05}))
    cfg, _ = model_configs(tc)
    params = init_params(cfg, jax.random.key(0))
    tx, trainable, sched = make_optimizer(tc, params, PHASE_MAIN)
    batch = next(SyntheticIterator(48, 4, cfg.vocab_size, seed=3))
    out = {}
    for hold in (None, held_router_biases(params, tuple(tc.optim.freeze))):
        step = jax.jit(make_train_step(StepSpec(cfg=cfg, router_bias_rate=0.05, mtp_weights=(0.3,)), tx, trainable,
                                       sched, hold=hold))
        out[hold is None] = step(init_state(params, tx, 0), batch)[0]["params"]["segments"][1]["mlp"]["router_bias"]
    np.testing.assert_array_equal(out[False], params["segments"][1]["mlp"]["router_bias"])
    assert not np.array_equal(out[True], params["segments"][1]["mlp"]["router_bias"])


def test_bf16_first_moment(tmp_path):
    """optim.mu_dtype=bfloat16: Adam's first moment is stored in bf16 (second moment float32) and the
    step's update stays close to the float32-moment one (first steps: mu = (1-b1) g in both)."""
    def run(mu_dtype):
        tc = from_dict(micro_train_dict(str(tmp_path / str(mu_dtype)), data={"kind": "synthetic", "seq_len": 32,
                                                                           "batch_size": 2},
                                        optim={"mu_dtype": mu_dtype}))
        cfg, _ = model_configs(tc)
        params = init_params(cfg, jax.random.key(1))
        tx, trainable, sched = make_optimizer(tc, params)
        state = init_state(params, tx, 0)
        step = jax.jit(make_train_step(StepSpec(cfg=cfg), tx, trainable, sched))
        batch = next(SyntheticIterator(32, 2, cfg.vocab_size, seed=5))
        for _ in range(3):
            state, m = step(state, batch)
        return params, state, m

    p0, s32, m32 = run(None)
    _, s16, m16 = run("bfloat16")
    # (host-side numpy: one tiny XLA compile per leaf shape would cost more than the steps)
    s16, s32, p0 = jax.device_get((s16, s32, p0))
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(s32["params"]), jax.tree.leaves(p0)))
    assert moved > 1e-3                                          # the steps did update the parameters
    mus = [x for p, x in jax.tree_util.tree_flatten_with_path(s16["opt_state"])[0]
           if any(getattr(k, "name", None) == "mu" for k in p)]
    nus = [x for p, x in jax.tree_util.tree_flatten_with_path(s16["opt_state"])[0]
           if any(getattr(k, "name", None) == "nu" for k in p)]
    assert mus and nus and all(x.dtype == jnp.bfloat16 for x in mus) and all(x.dtype == jnp.float32 for x in nus)
    np.testing.assert_allclose(m16["loss"], m32["loss"], rtol=1e-3)
    # bf16 rounding of the first moment changes each update by ~2^-9 of its size, more where the moment
    # nearly cancels; bound the total difference by a share of how far the parameters moved.
    diff = move = 0.0
    for a, b, c in zip(jax.tree.leaves(s16["params"]), jax.tree.leaves(s32["params"]), jax.tree.leaves(p0)):
        assert a.dtype == b.dtype
        diff += float(np.sum(np.abs(a - b)))
        move += float(np.sum(np.abs(b - c)))
    assert diff < 0.01 * move, (diff, move)
