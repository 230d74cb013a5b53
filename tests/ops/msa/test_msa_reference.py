"""MSA reference ops (minimax_jax.ops.msa, implementation="xla") against the NumPy oracle.

Covers MSA_SPEC.md sections 1-3 and issue 4: key lengths {1, 127, 128, 129, 2047, 2048, 2049, 2304}
with B=128, K=16; MSA == dense causal attention when the context fits in K*B; the all-equal-scores
tie case; queries as a suffix of keys; packed batches; sink / multi-local knobs; no gradient
through the selection; dispatch and input validation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import msa_oracle as oracle
from minimax_jax.ops import msa
from minimax_jax.ops.msa import pallas as msa_pallas
from minimax_jax.ops.registry import (ImplementationUnavailable, assume_backend, clear_implementation_report,
                                      implementation_report)

ATOL = 2e-5
RTOL = 2e-5


def make_inputs(rng, *, b=1, t, s, g=2, rep=2, d=16, di=16, dtype=np.float32):
    """Fresh gaussian q, k, v, qi, ki with the suffix layout q_pos = S - T + i."""
    return dict(
        q=rng.standard_normal((b, t, g * rep, d)).astype(dtype),
        k=rng.standard_normal((b, s, g, d)).astype(dtype),
        v=rng.standard_normal((b, s, g, d)).astype(dtype),
        qi=rng.standard_normal((b, t, g, di)).astype(dtype),
        ki=rng.standard_normal((b, s, di)).astype(dtype),
        q_pos=np.broadcast_to(np.arange(s - t, s), (b, t)).astype(np.int32),
        kv_pos=np.broadcast_to(np.arange(s), (b, s)).astype(np.int32),
        q_seg=np.zeros((b, t), np.int32),
        kv_seg=np.zeros((b, s), np.int32),
    )


def masks(x):
    return dict(q_positions=x["q_pos"], kv_positions=x["kv_pos"], q_segment_ids=x["q_seg"],
                kv_segment_ids=x["kv_seg"])


def oracle_masks(x):
    return x["q_pos"], x["kv_pos"], x["q_seg"], x["kv_seg"]


def assert_same_selection(ids, ref_ids, ref_scores, q_pos, block_size, tol=1e-5):
    """Selected SETS equal the oracle's (or differ only inside a score tie within ``tol``), and the
    local block is present whenever it has a visible key."""
    ids = np.asarray(ids)
    bsz, hi, t, _ = ids.shape
    for b in range(bsz):
        for r in range(hi):
            for i in range(t):
                got = {int(c) for c in ids[b, r, i] if c >= 0}
                want = {int(c) for c in ref_ids[b, r, i] if c >= 0}
                assert len(got) == int(np.sum(ids[b, r, i] >= 0)), f"duplicate ids at {(b, r, i)}: {ids[b, r, i]}"
                local = int(q_pos[b, i]) // block_size
                if local < ref_scores.shape[-1] and ref_scores[b, r, i, local] > -np.inf:
                    assert local in got, f"local block {local} missing at {(b, r, i)}: {sorted(got)}"
                if got != want:
                    sc = ref_scores[b, r, i]
                    extra, missing = got - want, want - got
                    assert len(extra) == len(missing), (b, r, i, sorted(got), sorted(want))
                    worst_missing = max(sc[c] for c in missing)
                    best_extra = min(sc[c] for c in extra)
                    assert worst_missing - best_extra <= tol, (b, r, i, sorted(got), sorted(want))


def assert_attention_close(o, lse, ref_o, ref_lse, atol=ATOL, rtol=RTOL):
    o, lse = np.asarray(o, np.float64), np.asarray(lse, np.float64)
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(o, ref_o, atol=atol, rtol=rtol)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------- key lengths

@pytest.mark.parametrize("s", [1, 127, 128, 129, 2047, 2048, 2049, 2304])
def test_key_lengths_against_oracle(s):
    """B=128, K=16, last min(S, 12) queries as a suffix: scores, id sets, o and lse vs the oracle."""
    rng = np.random.default_rng(s)
    block, topk = 128, 16
    t = min(s, 12)
    x = make_inputs(rng, t=t, s=s)
    scores = msa.msa_index_scores(jnp.asarray(x["qi"]), jnp.asarray(x["ki"]), block_size=block, **masks(x))
    ids = msa.msa_select_blocks(jnp.asarray(x["qi"]), jnp.asarray(x["ki"]), block_size=block, topk=topk,
                                **masks(x))
    ref_ids, ref_scores = oracle.select_blocks(x["qi"], x["ki"], *oracle_masks(x), block, topk)
    scores = np.asarray(scores)
    assert scores.shape == ref_scores.shape
    assert np.array_equal(np.isneginf(scores), np.isneginf(ref_scores))
    fin = np.isfinite(ref_scores)
    np.testing.assert_allclose(scores[fin], ref_scores[fin], atol=1e-5, rtol=1e-5)

    assert ids.shape == (1, 2, t, topk) and ids.dtype == jnp.int32
    assert_same_selection(ids, ref_ids, ref_scores, x["q_pos"], block)
    valid = np.sum(np.asarray(ids) >= 0, axis=-1)
    expect_valid = np.minimum(topk, x["q_pos"] // block + 1)[:, None, :]
    assert np.array_equal(valid, np.broadcast_to(expect_valid, valid.shape))

    o, lse = msa.msa_attention(jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["v"]), ids,
                               block_size=block, **masks(x))
    ref_o, ref_lse = oracle.attention(x["q"], x["k"], x["v"], np.asarray(ids), *oracle_masks(x), block)
    assert_attention_close(o, lse, ref_o, ref_lse)


def test_reference_order_and_chunking():
    """The xla reference emits the documented order (equal to the oracle's list, not only the set),
    and query chunking (lax.map over several chunks, a ragged last chunk) changes nothing beyond
    float32 rounding."""
    rng = np.random.default_rng(7)
    block, topk, s, t = 16, 5, 200, 23
    x = make_inputs(rng, t=t, s=s, b=2)
    args = (jnp.asarray(x["qi"]), jnp.asarray(x["ki"]))
    ids_one = msa.msa_select_blocks(*args, block_size=block, topk=topk, chunk_size=256, **masks(x))
    ids_chunked = msa.msa_select_blocks(*args, block_size=block, topk=topk, chunk_size=5, **masks(x))
    ref_ids, _ = oracle.select_blocks(x["qi"], x["ki"], *oracle_masks(x), block, topk)
    np.testing.assert_array_equal(np.asarray(ids_one), ref_ids)
    np.testing.assert_array_equal(np.asarray(ids_chunked), ref_ids)
    main = (jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["v"]), ids_one)
    o1, l1 = msa.msa_attention(*main, block_size=block, chunk_size=256, **masks(x))
    o2, l2 = msa.msa_attention(*main, block_size=block, chunk_size=5, **masks(x))
    # different chunk shapes may change float32 summation order only
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), atol=1e-6, rtol=1e-6)
    ref_o, ref_lse = oracle.attention(x["q"], x["k"], x["v"], ref_ids, *oracle_masks(x), block)
    assert_attention_close(o2, l2, ref_o, ref_lse)


# ----------------------------------------------------------------------------- dense equivalence

@pytest.mark.parametrize("s,block,topk", [(128, 16, 8), (37, 8, 5)])
def test_equals_dense_causal_attention_within_k_blocks(s, block, topk):
    """Context <= K*B: every visible block is selected and MSA == dense causal GQA attention
    (checked against jax.nn.dot_product_attention and the oracle's dense path), all T = S queries."""
    rng = np.random.default_rng(s)
    x = make_inputs(rng, t=s, s=s, b=2)
    ids = msa.msa_select_blocks(jnp.asarray(x["qi"]), jnp.asarray(x["ki"]), block_size=block, topk=topk,
                                **masks(x))
    local = x["q_pos"] // block
    got_sets = np.asarray(ids)
    for b in range(2):
        for r in range(2):
            for i in range(s):
                assert {int(c) for c in got_sets[b, r, i] if c >= 0} == set(range(local[b, i] + 1))
    o, lse = msa.msa_attention(jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["v"]), ids,
                               block_size=block, **masks(x))
    with jax.default_matmul_precision("highest"):  # GPU/TPU default to reduced-precision matmuls
        dense = jax.nn.dot_product_attention(jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["v"]),
                                             is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(o), np.asarray(dense), atol=ATOL, rtol=RTOL)
    ref_o, ref_lse = oracle.attention(x["q"], x["k"], x["v"], None, *oracle_masks(x), block)
    assert_attention_close(o, lse, ref_o, ref_lse)


# ----------------------------------------------------------------------------- ties

def test_all_equal_scores_18_blocks():
    """All-equal scores, 18 visible blocks (local = 17): ids are exactly [0..14, 17] (MSA_SPEC.md)."""
    s, block, topk = 18 * 128, 128, 16
    x = make_inputs(np.random.default_rng(0), t=3, s=s)
    qi = jnp.zeros_like(jnp.asarray(x["qi"]))  # every token score is 0
    ids = np.asarray(msa.msa_select_blocks(qi, jnp.asarray(x["ki"]), block_size=block, topk=topk, **masks(x)))
    want = list(range(15)) + [17]
    assert ids.shape == (1, 2, 3, 16)
    for r in range(2):
        for i in range(3):
            assert ids[0, r, i].tolist() == want
    ref_ids, _ = oracle.select_blocks(np.zeros_like(x["qi"]), x["ki"], *oracle_masks(x), block, topk)
    np.testing.assert_array_equal(ids, ref_ids)


# ----------------------------------------------------------------------------- suffix and packing

def test_suffix_queries_equal_prefill_rows():
    """A suffix of queries gives exactly the rows of the full prefill at the same positions."""
    rng = np.random.default_rng(3)
    block, topk, s, t = 8, 4, 90, 11
    full = make_inputs(rng, t=s, s=s)
    suf = dict(full)
    for key in ("q", "qi", "q_pos", "q_seg"):
        suf[key] = full[key][:, s - t:]
    outs = []
    for x in (full, suf):
        ids = msa.msa_select_blocks(jnp.asarray(x["qi"]), jnp.asarray(x["ki"]), block_size=block, topk=topk,
                                    chunk_size=32, **masks(x))
        o, lse = msa.msa_attention(jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["v"]), ids,
                                   block_size=block, chunk_size=32, **masks(x))
        outs.append((np.asarray(ids), np.asarray(o), np.asarray(lse)))
    np.testing.assert_array_equal(outs[0][0][:, :, s - t:], outs[1][0])
    np.testing.assert_allclose(outs[0][1][:, s - t:], outs[1][1], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(outs[0][2][:, s - t:], outs[1][2], atol=1e-6, rtol=1e-6)


def packed_inputs(rng, doc_lens_per_row, s, g=2, rep=2, d=16, di=16):
    """Rows of packed documents (positions restart per document), tail slots empty (segment -1)."""
    b = len(doc_lens_per_row)
    x = make_inputs(rng, b=b, t=s, s=s, g=g, rep=rep, d=d, di=di)
    pos = np.zeros((b, s), np.int32)
    seg = np.full((b, s), -1, np.int32)
    for row, lens in enumerate(doc_lens_per_row):
        start = 0
        for n, ln in enumerate(lens):
            pos[row, start:start + ln] = np.arange(ln)
            seg[row, start:start + ln] = n
            start += ln
        assert start <= s
    x.update(q_pos=pos, kv_pos=pos.copy(), q_seg=seg, kv_seg=seg.copy())
    return x


def test_packed_irregular_documents():
    """Packed rows with irregular document lengths and empty tail slots: ids, o, lse vs oracle, and
    each document equals the same document run alone."""
    rng = np.random.default_rng(11)
    block, topk, s = 8, 3, 120
    lens = [[37, 5, 50, 1, 20], [9, 100]]
    x = packed_inputs(rng, lens, s)
    ids = msa.msa_select_blocks(jnp.asarray(x["qi"]), jnp.asarray(x["ki"]), block_size=block, topk=topk,
                                chunk_size=16, **masks(x))
    ref_ids, ref_scores = oracle.select_blocks(x["qi"], x["ki"], *oracle_masks(x), block, topk)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    o, lse = msa.msa_attention(jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["v"]), ids,
                               block_size=block, chunk_size=16, **masks(x))
    ref_o, ref_lse = oracle.attention(x["q"], x["k"], x["v"], ref_ids, *oracle_masks(x), block)
    assert_attention_close(o, lse, ref_o, ref_lse)
    # empty slots (segment -1) see nothing: o = 0, lse = -inf, ids all -1
    empty = x["q_seg"] < 0
    assert empty.any()
    assert np.all(np.asarray(ids)[:, :, :][np.broadcast_to(empty[:, None, :], ids.shape[:3])] == -1)
    assert np.all(np.isneginf(np.asarray(lse)[empty]))
    # document 2 of row 0 alone
    a, ln = 42, 50
    alone = {key: (val[:1, a:a + ln] if val.ndim >= 2 else val) for key, val in x.items()}
    ids1 = msa.msa_select_blocks(jnp.asarray(alone["qi"]), jnp.asarray(alone["ki"]), block_size=block, topk=topk,
                                 **masks(alone))
    o1, lse1 = msa.msa_attention(jnp.asarray(alone["q"]), jnp.asarray(alone["k"]), jnp.asarray(alone["v"]), ids1,
                                 block_size=block, **masks(alone))
    np.testing.assert_array_equal(np.asarray(ids1), np.asarray(ids)[:1, :, a:a + ln])
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o)[:1, a:a + ln], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(lse1), np.asarray(lse)[:1, a:a + ln], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("init_blocks,local_blocks,topk", [(1, 1, 4), (0, 2, 4), (2, 3, 6), (1, 1, 2)])
def test_init_and_multi_local_blocks(init_blocks, local_blocks, topk):
    """Sink blocks and several local blocks are always kept; the rest ranked (oracle order)."""
    rng = np.random.default_rng(100 + topk)
    block, s, t = 8, 130, 40
    x = make_inputs(rng, t=t, s=s, b=2)
    ids = msa.msa_select_blocks(jnp.asarray(x["qi"]), jnp.asarray(x["ki"]), block_size=block, topk=topk,
                                init_blocks=init_blocks, local_blocks=local_blocks, chunk_size=16, **masks(x))
    ref_ids, _ = oracle.select_blocks(x["qi"], x["ki"], *oracle_masks(x), block, topk, init_blocks, local_blocks)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    local = x["q_pos"] // block
    got = np.asarray(ids)
    for b in range(2):
        for i in range(t):
            must = set(range(min(init_blocks, local[b, i]))) | set(range(max(0, local[b, i] - local_blocks + 1),
                                                                          local[b, i] + 1))
            for r in range(2):
                assert must <= set(got[b, r, i].tolist())


def test_bfloat16_inputs_follow_float32_math():
    """bf16 inputs: logits/softmax in fp32, o returned in bf16, lse in f32, close to the oracle."""
    rng = np.random.default_rng(5)
    block, topk, s, t = 16, 3, 100, 8
    x = make_inputs(rng, t=t, s=s)
    bf = {key: jnp.asarray(x[key], jnp.bfloat16) for key in ("q", "k", "v", "qi", "ki")}
    ids = msa.msa_select_blocks(bf["qi"], bf["ki"], block_size=block, topk=topk, **masks(x))
    o, lse = msa.msa_attention(bf["q"], bf["k"], bf["v"], ids, block_size=block, **masks(x))
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    as32 = {key: np.asarray(val.astype(jnp.float32)) for key, val in bf.items()}
    ref_o, ref_lse = oracle.attention(as32["q"], as32["k"], as32["v"], np.asarray(ids), *oracle_masks(x), block)
    assert_attention_close(np.asarray(o.astype(jnp.float32)), lse, ref_o, ref_lse, atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- gradients

def test_no_gradient_through_selection_and_attention_grads_match_dense_when_all_selected():
    """d(attention output)/d(qi, ki) is exactly zero (selection is discrete); d/d(q, k, v) equals the
    dense causal gradient when every block is selected (checks the rematerialised chunk backward)."""
    rng = np.random.default_rng(9)
    block, topk, s = 8, 8, 60
    x = make_inputs(rng, t=s, s=s)
    w = jnp.asarray(rng.standard_normal(x["q"].shape[:3] + (x["v"].shape[-1],)), jnp.float32)

    def loss(q, k, v, qi, ki):
        ids = msa.msa_select_blocks(qi, ki, block_size=block, topk=topk, **masks(x))
        o, lse = msa.msa_attention(q, k, v, ids, block_size=block, chunk_size=16, **masks(x))
        return jnp.sum(o * w) + jnp.sum(lse)

    def dense_loss(q, k, v):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        logits = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, 2, axis=2)) / np.sqrt(q.shape[-1])
        causal = np.tril(np.ones((s, s), bool))
        lse = jax.nn.logsumexp(jnp.where(causal, logits, -jnp.inf), axis=-1)
        return jnp.sum(o * w) + jnp.sum(lse)

    args = [jnp.asarray(x[key]) for key in ("q", "k", "v", "qi", "ki")]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    assert np.all(np.asarray(grads[3]) == 0) and np.all(np.asarray(grads[4]) == 0)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))(*args[:3])
    for got, want in zip(grads[:3], ref):
        assert np.abs(np.asarray(want)).max() > 0
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-5, rtol=5e-5)


# ----------------------------------------------------------------------------- dispatch

def _small(t=4, s=20):
    x = make_inputs(np.random.default_rng(1), t=t, s=s)
    return x, (jnp.asarray(x["qi"]), jnp.asarray(x["ki"]))


def test_auto_records_what_ran():
    """"auto" is "xla" on CPU; on GPU/TPU it is the backend's Pallas kernel when that imports."""
    x, (qi, ki) = _small(t=16, s=64)
    clear_implementation_report()
    ids = msa.msa_select_blocks(qi, ki, block_size=16, topk=2, implementation="auto", **masks(x))
    ran = implementation_report()["msa_select_blocks"]
    if jax.default_backend() == "cpu":
        assert ran == "xla"
    else:
        assert ran in ("xla", f"pallas_{jax.default_backend()}")
    ref_ids, _ = oracle.select_blocks(x["qi"], x["ki"], *oracle_masks(x), 16, 2)
    for i in range(16):
        for r in range(2):
            assert set(np.asarray(ids)[0, r, i].tolist()) == set(ref_ids[0, r, i].tolist()), (ran, r, i)


def test_unavailable_kernels_raise():
    """An explicit kernel that cannot serve the call raises, naming why; nothing falls back."""
    x, (qi, ki) = _small()
    for impl in ("pallas_gpu", "pallas_tpu"):
        if impl != f"pallas_{jax.default_backend()}":
            with pytest.raises(ImplementationUnavailable, match="needs a (GPU|TPU) backend"):
                msa.msa_select_blocks(qi, ki, block_size=4, topk=2, implementation=impl, **masks(x))
    with pytest.raises(ImplementationUnavailable, match="power of two >= 16"):   # GPU tiles
        msa.msa_select_blocks(qi, ki, block_size=4, topk=2, implementation="pallas_gpu_interpret", **masks(x))
    with pytest.raises(ImplementationUnavailable, match="unknown implementation"):
        msa.msa_select_blocks(qi, ki, block_size=4, topk=2, implementation="cuda", **masks(x))


def test_kernel_dispatch_passes_arguments_and_records(monkeypatch):
    x, (qi, ki) = _small()
    calls = {}

    def msa_select_blocks_tpu(qi_, ki_, **kw):
        calls.update(kw)
        return jnp.zeros((1, 2, 4, 2), jnp.int32) - 7

    monkeypatch.setattr(msa_pallas, "msa_select_blocks_tpu", msa_select_blocks_tpu)
    clear_implementation_report()
    out = msa.msa_select_blocks(qi, ki, block_size=4, topk=2, implementation="pallas_tpu_interpret", **masks(x))
    assert np.all(np.asarray(out) == -7)
    assert calls["interpret"] is True and calls["topk"] == 2 and calls["block_size"] == 4
    assert "chunk_size" not in calls           # tunes only the xla reference
    assert implementation_report()["msa_select_blocks"] == "pallas_tpu_interpret"
    with pytest.raises(ImplementationUnavailable, match="unknown implementation 'pallas_gpu'"):
        msa.msa_index_scores(qi, ki, block_size=4, implementation="pallas_gpu", **masks(x))   # no kernel


def test_auto_consults_kernel_supports(monkeypatch):
    """On a GPU backend, "auto" takes the kernel only when its ``supports`` accepts the call;
    otherwise it runs "xla" and records the kernel's reason (no silent fallback)."""
    x, (qi, ki) = _small()
    fake_kernel = lambda qi_, ki_, **kw: jnp.full((1, 2, 4, 2), 5, jnp.int32)  # noqa: E731
    monkeypatch.setattr(msa_pallas, "msa_select_blocks_gpu", fake_kernel)
    clear_implementation_report()
    with assume_backend("gpu"):
        ids = msa.msa_select_blocks(qi, ki, block_size=4, topk=2, implementation="auto", **masks(x))
    report = implementation_report()
    assert report["msa_select_blocks"] == "xla" and "power of two" in report["msa_select_blocks.auto_reason"]
    ref_ids, _ = oracle.select_blocks(x["qi"], x["ki"], *oracle_masks(x), 4, 2)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    clear_implementation_report()
    with assume_backend("gpu"):
        ids = msa.msa_select_blocks(qi, ki, block_size=16, topk=2, implementation="auto", **masks(x))
    assert implementation_report()["msa_select_blocks"] == "pallas_gpu" and np.all(np.asarray(ids) == 5)


# ----------------------------------------------------------------------------- validation

def test_bad_inputs_raise_clear_errors():
    x, (qi, ki) = _small()
    kw = masks(x)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        msa.msa_select_blocks(qi, ki, block_size=0, topk=2, **kw)
    with pytest.raises(ValueError, match="topk must be >= 1"):
        msa.msa_select_blocks(qi, ki, block_size=4, topk=0, **kw)
    with pytest.raises(ValueError, match="exceeds topk"):
        msa.msa_select_blocks(qi, ki, block_size=4, topk=2, init_blocks=1, local_blocks=2, **kw)
    with pytest.raises(ValueError, match="ki must have shape"):
        msa.msa_select_blocks(qi, ki[..., :3], block_size=4, topk=2, **kw)
    with pytest.raises(ValueError, match="qi must have 4 dims"):
        msa.msa_select_blocks(qi[0], ki, block_size=4, topk=2, **kw)
    with pytest.raises(TypeError, match="q_positions must be an integer dtype"):
        msa.msa_select_blocks(qi, ki, block_size=4, topk=2, **{**kw, "q_positions": x["q_pos"].astype(np.float32)})
    with pytest.raises(ValueError, match="kv_positions must have shape"):
        msa.msa_select_blocks(qi, ki, block_size=4, topk=2, **{**kw, "kv_positions": x["kv_pos"][:, :5]})
    with pytest.raises(ValueError, match="both q_segment_ids and kv_segment_ids"):
        msa.msa_select_blocks(qi, ki, block_size=4, topk=2, **{**kw, "q_segment_ids": None})
    with pytest.raises(ValueError, match="must lie in"):
        msa.msa_select_blocks(qi, ki, block_size=4, topk=2, **{**kw, "kv_positions": x["kv_pos"] + 100})
    with pytest.raises(TypeError, match="floating dtype"):
        msa.msa_select_blocks(qi.astype(jnp.int32), ki, block_size=4, topk=2, **kw)
    q, k, v = (jnp.asarray(x[key]) for key in ("q", "k", "v"))
    ids = msa.msa_select_blocks(qi, ki, block_size=4, topk=2, **kw)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        msa.msa_attention(q[:, :, :3], k, v, ids, block_size=4, **kw)
    with pytest.raises(ValueError, match="block_ids must have shape"):
        msa.msa_attention(q, k, v, ids[:, :1], block_size=4, **kw)
    with pytest.raises(TypeError, match="block_ids must be an integer dtype"):
        msa.msa_attention(q, k, v, ids.astype(jnp.float32), block_size=4, **kw)
    with pytest.raises(ValueError, match="v must have shape"):
        msa.msa_attention(q, k, v[:, :3], ids, block_size=4, **kw)


# ----------------------------------------------------------------------------- memory scaling

def _temp_mib(fn, *args, **kw):
    return fn.lower(*args, **kw).compile().memory_analysis().temp_size_in_bytes / 2**20


def _specs(t, s, g=2, rep=2, d=16, k=16):
    sd = jax.ShapeDtypeStruct
    return dict(qi=sd((1, t, g, d), jnp.float32), ki=sd((1, s, d), jnp.float32), q=sd((1, t, g * rep, d), jnp.float32),
                k=sd((1, s, g, d), jnp.float32), ids=sd((1, g, t, k), jnp.int32), qp=sd((1, t), jnp.int32),
                kp=sd((1, s), jnp.int32))


def test_reference_memory_is_o_chunk_times_s():
    """Compiled temporary memory of selection and attention barely grows with T at fixed chunk size
    (O(T) outputs only), while one chunk holding all T queries (O(T * S)) needs far more."""
    from minimax_jax.ops.msa import reference as ref

    s, chunk = 512, 32
    temps = {}
    for t, c in ((128, chunk), (512, chunk), (512, 512)):
        x = _specs(t, s)
        sel = _temp_mib(ref.select_blocks, x["qi"], x["ki"], x["qp"], x["kp"], x["qp"], x["kp"], block_size=128,
                        topk=16, init_blocks=0, local_blocks=1, chunk_size=c)
        att = _temp_mib(ref.attention, x["q"], x["k"], x["k"], x["ids"], x["qp"], x["kp"], x["qp"], x["kp"],
                        block_size=128, chunk_size=c)
        temps[(t, c)] = (sel, att)
    for n in range(2):  # 4x the queries adds far less than O(T * S) would, and far less than one big chunk
        assert temps[(512, chunk)][n] - temps[(128, chunk)][n] < 0.1 * temps[(512, 512)][n], temps
        assert temps[(512, 512)][n] > 4 * temps[(512, chunk)][n], temps


# ----------------------------------------------------------------------------- HF transformers

def test_selection_sets_match_hf_transformers_indexer():
    """Same selected SETS as transformers' MiniMaxM3VLIndexer (local block forced via +inf, top-K over
    all blocks, no 1/sqrt(Di) scale) on a 2304-token prefill, B=128, K=16 (18 blocks)."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    s, hidden, hi, di = 2304, 32, 2, 16
    cfg = MiniMaxM3VLTextConfig(hidden_size=hidden, index_n_heads=hi, index_head_dim=di, index_block_size=128,
                                index_topk_blocks=16, index_local_blocks=1, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    indexer = hf.MiniMaxM3VLIndexer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in indexer.parameters():
            p.normal_(0.0, 0.3)
        h = torch.randn(1, s, hidden)
        pos = torch.arange(s)[None]
        cos, sin = torch.ones(1, s, di), torch.zeros(1, s, di)  # identity rotation: RoPE is not under test
        hf_ids = indexer(h, (cos, sin), None, pos).numpy()  # [1, Hi, S, K]
        qi = indexer.q_norm(indexer.q_proj(h).view(1, s, hi, di)).numpy()
        ki = indexer.k_norm(indexer.k_proj(h).view(1, s, 1, di))[:, :, 0].numpy()
    x = dict(q_pos=np.arange(s, dtype=np.int32)[None], kv_pos=np.arange(s, dtype=np.int32)[None],
             q_seg=np.zeros((1, s), np.int32), kv_seg=np.zeros((1, s), np.int32))
    ids = msa.msa_select_blocks(jnp.asarray(qi), jnp.asarray(ki), block_size=128, topk=16, **masks(x))
    scores = np.asarray(msa.msa_index_scores(jnp.asarray(qi), jnp.asarray(ki), block_size=128, **masks(x)))
    assert hf_ids.shape == ids.shape
    assert_same_selection(ids, hf_ids, scores, x["q_pos"], 128, tol=1e-5)
    assert np.array_equal(np.sum(np.asarray(ids) >= 0, -1), np.sum(hf_ids >= 0, -1))


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu_interpret"])
def test_out_of_range_ids_select_nothing_even_when_id_times_block_overflows(impl):
    """Ids >= NB (here up to 2**31 - 1, so ``id * block_size`` overflows int32) are empty slots for
    every implementation, as in the reference: the output equals the call without them."""
    rng = np.random.default_rng(3)
    x = make_inputs(rng, t=8, s=64)
    blk = 16
    ids = np.broadcast_to(np.array([3, 0, -1], np.int32), (1, 2, 8, 3)).copy()
    ids[..., 0] = np.minimum(ids[..., 0], x["q_pos"][0] // blk)           # a visible block
    huge = np.concatenate([ids, np.full(ids.shape[:3] + (1,), 2**31 - 1, np.int32),
                           np.full(ids.shape[:3] + (1,), 2**28 + 2, np.int32)], axis=-1)   # * 16 wraps to 32
    args = (jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["v"]))
    want = msa.msa_attention(*args, jnp.asarray(ids), block_size=blk, implementation="xla", **masks(x))
    got = msa.msa_attention(*args, jnp.asarray(huge), block_size=blk, implementation=impl, **masks(x))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=RTOL)
    qk = (jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["qi"]), jnp.asarray(x["ki"]))
    kl_want = msa.indexer_kl(*qk, jnp.asarray(ids[:, :2]), block_size=blk, implementation="xla", **masks(x))
    kl_got = msa.indexer_kl(*qk, jnp.asarray(huge[:, :2]), block_size=blk, implementation=impl, **masks(x))
    np.testing.assert_allclose(float(kl_got[0]), float(kl_want[0]), rtol=1e-5, atol=1e-6)
    assert int(kl_got[1]) == int(kl_want[1])
