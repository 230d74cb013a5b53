"""The Mosaic TPU MSA kernels lower for TPU on this CPU-only machine (jax.export, platforms=["tpu"]).

This catches real layout errors (block shapes that are not full dims or (8, 128) multiples,
primitives without a Mosaic lowering) without TPU hardware; the final device compile is not run.
Shapes follow M3 per group (D = Di = 128, B = 128) at a small T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.msa.tpu_attention import msa_attention_tpu
from pallas_kernels.msa.tpu_indexer import msa_select_blocks_tpu

sd = jax.ShapeDtypeStruct


def _export(f, *args):
    return jax.export.export(jax.jit(f), platforms=["tpu"])(*args)


@pytest.mark.parametrize("h,g", [(16, 2), (12, 2)])   # group of 8 heads; group of 6 (padded to 8)
def test_attention_fwd_and_grad_lower_for_tpu(h, g):
    b, t, s, d, k = 1, 256, 1024, 128, 4
    args = (sd((b, t, h, d), jnp.bfloat16), sd((b, s, g, d), jnp.bfloat16),
            sd((b, s, g, d), jnp.bfloat16), sd((b, g, t, k), jnp.int32), sd((b, t), jnp.int32),
            sd((b, s), jnp.int32), sd((b, t), jnp.int32), sd((b, s), jnp.int32))

    def fwd(q, kk, v, ids, qp, kp, qs, ks):
        return msa_attention_tpu(q, kk, v, ids, q_positions=qp, kv_positions=kp, q_segment_ids=qs,
                                 kv_segment_ids=ks, block_size=128)

    def grad(q, kk, v, ids, qp, kp, qs, ks):
        loss = lambda q, kk, v: fwd(q, kk, v, ids, qp, kp, qs, ks)[0].astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, kk, v)

    for f in (fwd, grad):
        text = _export(f, *args).mlir_module()
        assert "tpu_custom_call" in text
    assert text.count("tpu_custom_call") >= 3    # fwd, dq, dk/dv


def test_indexer_lowers_for_tpu():
    b, t, s, hi, di = 1, 256, 1024, 4, 128
    args = (sd((b, t, hi, di), jnp.bfloat16), sd((b, s, di), jnp.bfloat16), sd((b, t), jnp.int32),
            sd((b, s), jnp.int32))

    def f(qi, ki, qp, kp):
        return msa_select_blocks_tpu(qi, ki, q_positions=qp, kv_positions=kp, block_size=128,
                                     topk=16)
    text = _export(f, *args).mlir_module()
    assert "tpu_custom_call" in text
