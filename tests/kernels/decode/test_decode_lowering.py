"""The decode kernels lower for their real targets on a CPU-only machine (M3 shapes).

GPU: Pallas -> Triton IR through ``.lower(lowering_platforms=("cuda",))`` (the final Triton
compile needs the GPU). TPU: ``jax.export`` for platform "tpu" runs Mosaic's lowering and catches
layout errors (block shapes, unsupported ops). bf16 and fp8 e4m3 caches, dense and sparse modes
(GPU: also the split top-k selection, sparse attention with several pages per program, the
persistent page-scoring kernel, key loads with an L2 eviction policy, and the attention tilings:
shared 128-row tiles at Q = 8 / 16, per-row legacy tiles, static loops).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import dataclasses

from pallas_kernels.decode.gpu_attention import paged_attention_gpu
from pallas_kernels.decode.gpu_config import DEFAULT_TABLE, LEGACY_TILES
from pallas_kernels.decode.gpu_select import select_pages_gpu
from pallas_kernels.decode.tpu import page_scores_tpu, paged_attention_tpu

S = jax.ShapeDtypeStruct
B, Q, G, HG, D, DI, PAGE, P, NP, K = 2, 2, 4, 16, 128, 128, 128, 1100, 512, 16
DTYPES = [jnp.bfloat16, jnp.float8_e4m3fn]


def _index_args(dt, b=B, npg=NP):
    fp8 = dt == jnp.float8_e4m3fn
    return (S((b, Q, G, DI), jnp.bfloat16), S((P, PAGE, DI), dt), S((b, npg), jnp.int32), S((b, Q), jnp.int32),
            S((P, PAGE), jnp.float32) if fp8 else None)


def _attn_args(dt, sparse, nq=Q):
    fp8 = dt == jnp.float8_e4m3fn
    sc = [S((G, P, PAGE), jnp.float32)] * 2 if fp8 else [None, None]
    return (S((B, nq, G * HG, D), jnp.bfloat16), S((G, P, PAGE, D), dt), S((G, P, PAGE, D), dt),
            S((B, NP), jnp.int32), S((B, nq), jnp.int32), *sc, S((B, G, nq, K), jnp.int32) if sparse else None)


def _cuda_text(f, args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dt", DTYPES)
def test_gpu_kernels_lower_to_triton(dt):
    txt = _cuda_text(lambda *a: select_pages_gpu(*a, topk=K), _index_args(dt))
    assert txt.count("__gpu$xla.gpu.triton") == 2           # 512 pages (< SPLIT_MIN_WIDTH): single-stage selection
    txt = _cuda_text(lambda *a: select_pages_gpu(*a, topk=K), _index_args(dt, npg=2048))
    assert txt.count("__gpu$xla.gpu.triton") == 3           # 2,048 pages: the default split top-k (slices, merge)
    txt = _cuda_text(lambda *a: select_pages_gpu(*a, topk=K, select_splits=1), _index_args(dt))
    assert txt.count("__gpu$xla.gpu.triton") == 2           # scoring + single-stage selection
    txt = _cuda_text(lambda *a: select_pages_gpu(*a, topk=K, unroll=4, num_stages=4, f16=True, select_splits=1),
                     _index_args(dt))
    assert txt.count("__gpu$xla.gpu.triton") == 2           # the unrolled scoring variant
    txt = _cuda_text(lambda *a: select_pages_gpu(*a, topk=K, select_splits=4, init_blocks=1, local_blocks=2),
                     _index_args(dt))
    assert txt.count("__gpu$xla.gpu.triton") == 3           # scoring + split top-k (slices, merge)
    for b in (B, 1, 3):                                      # persistent scoring (B padded to a power of two)
        for kw in (dict(programs=264), dict(programs=132, num_warps=1, num_stages=4, evict="evict_first")):
            txt = _cuda_text(lambda *a: select_pages_gpu(*a, topk=K, **kw), _index_args(dt, b))
            assert txt.count("__gpu$xla.gpu.triton") == 2, (b, kw)
    txt = _cuda_text(lambda *a: select_pages_gpu(*a, topk=K), _index_args(dt, 40))
    assert txt.count("__gpu$xla.gpu.triton") == 2           # the "large" size class's launch (40 x 512 pages)
    txt = _cuda_text(lambda *a: select_pages_gpu(*a, topk=K, evict="evict_last", select_splits=1), _index_args(dt))
    assert txt.count("__gpu$xla.gpu.triton") == 2           # chunked scoring with an eviction policy
    for sparse in (False, True):
        txt = _cuda_text(lambda *a: paged_attention_gpu(*a), _attn_args(dt, sparse))
        assert "__gpu$xla.gpu.triton" in txt
    for loop in ("dynamic", "static"):                       # sparse, 4 selected pages per program
        txt = _cuda_text(lambda *a: paged_attention_gpu(*a, sparse_pages_per_split=4, loop=loop),
                         _attn_args(dt, True))
        assert "__gpu$xla.gpu.triton" in txt


@pytest.mark.parametrize("dt", DTYPES)
def test_gpu_attention_tilings_lower_to_triton(dt):
    static = dataclasses.replace(DEFAULT_TABLE, loop="static")
    for nq in (1, 8, 16):
        for table in (DEFAULT_TABLE, LEGACY_TILES, static):
            for sparse in (False, True):
                txt = _cuda_text(lambda *a: paged_attention_gpu(*a, table=table), _attn_args(dt, sparse, nq))
                shared = sparse and table.sparse_tile == "shared"       # Q = 1: + the page-union kernel (gpu_union)
                assert txt.count("__gpu$xla.gpu.triton") == 1 + (shared and nq == 1), (nq, table.sparse_tile, sparse)
                wide = nq > 1 and table.tile_rows > 64 and (not sparse or table.sparse_tile == "shared")   # 128 rows
                assert f"num_warps = {8 if wide else 4} : i32" in txt, (nq, table.sparse_tile, sparse)


@pytest.mark.parametrize("nq", [1, 3, 8])
def test_triton_dense_attention_reads_the_query_positions_itself(nq):
    """The Triton attention kernel takes the query positions as given: its row positions and its dense page
    count are computed in the kernel, so no XLA reduction or position arithmetic runs before the launch (each
    would be a kernel launch of its own on the GPU)."""
    triton = dataclasses.replace(DEFAULT_TABLE, tile_kernel="triton")
    txt = _cuda_text(lambda *a: paged_attention_gpu(*a, table=triton), _attn_args(jnp.bfloat16, False, nq))
    before = txt[txt.find("func.func public @main"): txt.find("__gpu$xla.gpu.triton")]
    assert txt.count("__gpu$xla.gpu.triton") == 1
    assert not any(op in before for op in ("stablehlo.reduce", "stablehlo.add", "stablehlo.compare")), nq


def test_fp8_caches_in_the_int32_offset_gap_lower_as_byte_pairs():
    """fp8 index keys of 2**31 elements (131,072 pages of 128 x 128) and fp8 K / V of 4 x 32,768 pages: the
    Triton kernels read them as uint16 byte pairs (common.needs_byte_pairs) and lower for CUDA."""
    p_ki, p_kv = 1 << 17, 1 << 15
    fp8 = jnp.float8_e4m3fn
    args = (S((B, Q, G, DI), jnp.bfloat16), S((p_ki, PAGE, DI), fp8), S((B, NP), jnp.int32), S((B, Q), jnp.int32),
            S((p_ki, PAGE), jnp.float32))
    txt = _cuda_text(lambda *a: select_pages_gpu(*a, topk=K), args)
    assert txt.count("__gpu$xla.gpu.triton") == 2 and "ui16" in txt
    sc = [S((G, p_kv, PAGE), jnp.float32)] * 2
    args = (S((B, 1, G * HG, D), jnp.bfloat16), S((G, p_kv, PAGE, D), fp8), S((G, p_kv, PAGE, D), fp8),
            S((B, NP), jnp.int32), S((B, 1), jnp.int32), *sc, None)
    txt = _cuda_text(lambda *a: paged_attention_gpu(*a), args)
    assert txt.count("__gpu$xla.gpu.triton") == 1 and "ui16" in txt


@pytest.mark.parametrize("dt", DTYPES)
def test_tpu_kernels_export(dt):
    exp = jax.export.export(jax.jit(lambda *a: page_scores_tpu(*a)), platforms=["tpu"])(*_index_args(dt))
    assert "tpu_custom_call" in exp.mlir_module()
    for sparse in (False, True):
        exp = jax.export.export(jax.jit(lambda *a: paged_attention_tpu(*a)), platforms=["tpu"])(*_attn_args(dt, sparse))
        assert "tpu_custom_call" in exp.mlir_module()
