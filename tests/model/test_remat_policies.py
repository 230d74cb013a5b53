"""forward(remat=...): every policy gives the same loss and gradients, and ``"dots_kernels"`` keeps the
fused kernels' outputs so the backward pass does not run their forward again (counted in the jaxpr)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import load_config
from minimax_jax.model import forward, init_params


def _setup():
    cfg = load_config("tiny-m3").replace(num_layers=2, layer_types=("full", "full"), mlp_types=("moe", "moe"),
                                         num_mtp_modules=0, attention_impl="pallas_flash_gpu_interpret",
                                         moe_impl="pallas_gpu_interpret")
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    t = 32
    seg = jnp.asarray((np.arange(t) >= 13).astype(np.int32))[None].repeat(2, 0)
    pos = jnp.asarray(np.where(np.arange(t) >= 13, np.arange(t) - 13, np.arange(t)).astype(np.int32))[None].repeat(2, 0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, t)), jnp.int32)

    def loss(p, remat):
        logits = forward(p, cfg, tokens, positions=pos, segment_ids=seg, remat=remat).logits
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])
    return params, loss


def _pallas_calls(jaxpr) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "pallas_call"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _pallas_calls(sub)
    return n


def test_policies_agree_and_dots_kernels_skips_kernel_recompute():
    with jax.default_matmul_precision("highest"):      # fp32 matmuls also on a GPU (no TF32)
        _check_policies()


def _check_policies():
    params, loss = _setup()
    vg = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    ref_val, ref_grads = vg(params, "none")
    for remat in ("full", "dots", "dots_kernels"):
        val, grads = vg(params, remat)
        np.testing.assert_allclose(float(val), float(ref_val), rtol=1e-6)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7,
                                       err_msg=f"{remat} {jax.tree_util.keystr(path)}")
    counts = {r: _pallas_calls(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, r).jaxpr)
              for r in ("none", "dots", "dots_kernels")}
    # "none" and "dots_kernels" run each kernel once (forward, backward); "dots" runs the forward kernels again
    assert counts["dots_kernels"] == counts["none"] < counts["dots"], counts
    with pytest.raises(ValueError, match="dots_kernels"):
        loss(params, "some")
