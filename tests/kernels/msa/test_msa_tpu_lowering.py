"""The Mosaic TPU MSA kernels lower for TPU on this CPU-only machine (jax.export, platforms=["tpu"]).

This catches real layout errors (block shapes that are not full dims or (8, 128) multiples,
primitives without a Mosaic lowering) without TPU hardware; the final device compile is not run.
Shapes follow M3 per group (D = Di = 128, B = 128). At T = S = 64K and 1M tokens (M3: 64 heads,
4 kv groups, 4 index heads, top-16; ShapeDtypeStruct inputs, nothing materialised) every op lowers
to a fixed set of pallas_calls (one per kernel, inside loops), whose scalar-prefetch tables (the
1-D int32 operands) fit tpu_common.TABLE_WORDS, and the export is fast.
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.msa.tpu_attention import msa_attention_tpu
from pallas_kernels.msa.tpu_common import TABLE_WORDS
from pallas_kernels.msa.tpu_indexer import msa_select_blocks_tpu
from pallas_kernels.msa.tpu_kl import indexer_kl_tpu

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


# ----------------------------------------------------------------------------- M3 at 64K and 1M

_H, _G, _D, _HI, _K, _BLK = 64, 4, 128, 4, 16, 128


def _m3_ops(t):
    """name -> (function, ShapeDtypeStruct args) at T = S = t."""
    bf, i32 = jnp.bfloat16, jnp.int32
    q, kv = sd((1, t, _H, _D), bf), sd((1, t, _G, _D), bf)
    ids, qp = sd((1, _G, t, _K), i32), sd((1, t), i32)
    qi, ki, qix = sd((1, t, _G, _D), bf), sd((1, t, _D), bf), sd((1, t, _HI, _D), bf)
    pos = lambda qp, kp, qs, ks: dict(q_positions=qp, kv_positions=kp, q_segment_ids=qs,  # noqa: E731
                                      kv_segment_ids=ks, block_size=_BLK)

    def attn(q, k, v, ids, qp, kp, qs, ks):
        return msa_attention_tpu(q, k, v, ids, **pos(qp, kp, qs, ks))

    def attn_grad(q, k, v, ids, qp, kp, qs, ks):
        loss = lambda q, k, v: attn(q, k, v, ids, qp, kp, qs, ks)[0].astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def kl_grad(q, k, qi, ki, ids, qp, kp, qs, ks):
        loss = lambda qi, ki: indexer_kl_tpu(q, k, qi, ki, ids, **pos(qp, kp, qs, ks))[0]
        return jax.value_and_grad(loss, argnums=(0, 1))(qi, ki)

    def indexer(qi, ki, qp, kp, qs, ks):
        return msa_select_blocks_tpu(qi, ki, topk=_K, **pos(qp, kp, qs, ks))
    return {"attention_fwd": (attn, (q, kv, kv, ids, qp, qp, qp, qp)),
            "attention_fwd_bwd": (attn_grad, (q, kv, kv, ids, qp, qp, qp, qp)),
            "kl_fwd_bwd": (kl_grad, (q, kv, qi, ki, ids, qp, qp, qp, qp)),
            "indexer": (indexer, (qix, ki, qp, qp, qp, qp))}


_KERNELS = {"attention_fwd": ["msa_fwd_tpu"],
            "attention_fwd_bwd": ["msa_dkdv_tpu", "msa_dq_tpu", "msa_fwd_tpu"],
            "kl_fwd_bwd": ["msa_kl_dki_tpu", "msa_kl_dqi_tpu", "msa_kl_fwd_tpu"],
            "indexer": ["msa_indexer_tpu"]}


def _custom_calls(text):
    """[(kernel name, int32 words in its 1-D operands = the scalar-prefetch tables)]."""
    out = []
    for line in text.splitlines():
        if "stablehlo.custom_call @tpu_custom_call" not in line:
            continue
        name = re.search(r'kernel_name = "(\w+)"', line).group(1)
        operands = line.rsplit(" : (", 1)[1].split(") -> ")[0]
        words = sum(int(n) for n in re.findall(r"tensor<(\d+)xi32>", operands))
        out.append((name, words))
    return sorted(out)


@pytest.mark.parametrize("op", list(_KERNELS))
def test_m3_export_at_1m_tokens_is_bounded(op):
    found = {}
    for t in (1 << 16, 1 << 20):
        f, args = _m3_ops(t)[op]
        t0 = time.perf_counter()
        text = _export(f, *args).mlir_module()
        seconds = time.perf_counter() - t0
        assert seconds < 20.0, f"{op} at T={t}: export took {seconds:.1f} s"
        calls = _custom_calls(text)
        assert [n for n, _ in calls] == _KERNELS[op], calls        # one pallas_call per kernel
        assert all(0 < w <= TABLE_WORDS for _, w in calls), calls   # SMEM tables within budget
        found[t] = calls
    assert [n for n, _ in found[1 << 16]] == [n for n, _ in found[1 << 20]]
