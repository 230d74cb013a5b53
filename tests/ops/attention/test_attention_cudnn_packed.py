"""attention(implementation="cudnn_packed"): the segment-run offsets cuDNN's packed layout gets, their
meaning (attention causal inside each run equals the op's position/segment contract), the clear error
off GPU, and on a Hopper GPU the compiled cuDNN path against the XLA reference (outputs and gradients),
including the flash fallback for a row with more runs than ``max_segments``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import registry
from minimax_jax.ops.attention import attention
from minimax_jax.ops.attention import cudnn as cudnn_packed
from minimax_jax.ops.attention import flash
from minimax_jax.ops.registry import ImplementationUnavailable, clear_implementation_report, implementation_report

ON_GPU = jax.default_backend() == "gpu"


def _packed_row(rng, t, n_docs, pad):
    """Segment ids and positions of one row: ``n_docs`` documents of random lengths, then ``pad`` -1s."""
    cuts = np.sort(rng.choice(np.arange(1, t - pad), size=n_docs - 1, replace=False))
    lens = np.diff(np.concatenate([[0], cuts, [t - pad]]))
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)] + [np.full(pad, -1)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens] + [np.zeros(pad, int)]).astype(np.int32)
    return seg, pos


def _runs_numpy(seg):
    starts = [0] + [i for i in range(1, len(seg)) if seg[i] != seg[i - 1]]
    return starts, [e - s for s, e in zip(starts, starts[1:] + [len(seg)])]


@pytest.mark.parametrize("m", [1, 3, 8])
def test_segment_runs_match_numpy(m):
    rng = np.random.default_rng(0)
    rows = [_packed_row(rng, 64, n, pad)[0] for n, pad in ((1, 0), (3, 5), (6, 0), (2, 20))]
    seg = np.stack(rows)
    seqlen, offsets, count = (np.asarray(x) for x in jax.jit(cudnn_packed.segment_runs, static_argnums=1)(seg, m))
    assert seqlen.shape == (4, m) and offsets.shape == (4, m + 1) and seqlen.dtype == np.int32
    for r, row in enumerate(rows):
        starts, lens = _runs_numpy(row)
        assert count[r] == len(starts)
        n = min(m, len(starts))
        np.testing.assert_array_equal(offsets[r, :n], starts[:n])
        np.testing.assert_array_equal(offsets[r, n:], -1)
        np.testing.assert_array_equal(seqlen[r, :n], lens[:n])
        np.testing.assert_array_equal(seqlen[r, n:], -1)
    with pytest.raises(ValueError, match="max_segments"):
        cudnn_packed.segment_runs(seg, 0)


def test_runs_describe_the_op_contract():
    """Attention causal inside each [offset, offset + seqlen) run (what cuDNN computes in its packed
    layout), with negative-segment rows zeroed, equals the XLA reference of the op's contract."""
    rng = np.random.default_rng(1)
    b, t, h, g, d = 2, 48, 4, 2, 8
    rows = [_packed_row(rng, t, 3, 6), _packed_row(rng, t, 2, 0)]
    seg, pos = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    q, k, v = (rng.standard_normal((b, t, n, d)).astype(np.float32) for n in (h, g, g))
    with jax.default_matmul_precision("highest"):          # (on a GPU: no TF32 in the reference)
        want = np.asarray(attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                                    kv_segment_ids=seg, implementation="xla"))
    seqlen, offsets, count = (np.asarray(x) for x in cudnn_packed.segment_runs(jnp.asarray(seg), 8))
    got = np.zeros_like(q)
    kr, vr = np.repeat(k, h // g, 2), np.repeat(v, h // g, 2)
    for r in range(b):
        for o, n in zip(offsets[r], seqlen[r]):
            if n <= 0:
                continue
            s = np.einsum("thd,shd->hts", q[r, o:o + n], kr[r, o:o + n]) / np.sqrt(d)
            s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            got[r, o:o + n] = np.einsum("hts,shd->thd", p, vr[r, o:o + n])
    got = np.where((seg >= 0)[:, :, None, None], got, 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bucket_index_and_bad_bounds():
    count = jnp.asarray([1, 3, 2])
    assert int(cudnn_packed.bucket_index(count, (2, 8, 32))) == 1
    assert int(cudnn_packed.bucket_index(count[:1], (2, 8, 32))) == 0
    assert int(cudnn_packed.bucket_index(jnp.asarray([40]), (2, 8, 32))) == 3       # past every bound: flash
    q = jnp.zeros((1, 16, 2, 16), jnp.bfloat16)
    seg = jnp.ones((1, 16), jnp.int32)
    for bad in (1, (8, 2), (2, 2), ()):
        with pytest.raises(ValueError, match="increasing integers >= 2"):
            cudnn_packed.packed_attention(q, q[:, :, :1], q[:, :, :1], seg, max_segments=bad)
    with pytest.raises(ValueError, match="overflow must be one of"):
        cudnn_packed.packed_attention(q, q[:, :, :1], q[:, :, :1], seg, overflow="ignore")


@pytest.mark.skipif(ON_GPU, reason="the error is for machines without a CUDA GPU")
def test_off_gpu_is_a_clear_error():
    q = jnp.zeros((1, 16, 2, 16), jnp.bfloat16)
    k = jnp.zeros((1, 16, 1, 16), jnp.bfloat16)
    pos = jnp.arange(16)[None]
    seg = jnp.ones((1, 16), jnp.int32)
    with pytest.raises(ImplementationUnavailable, match="'cudnn_packed' .*needs a GPU backend"):
        attention(q, k, k, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                  implementation="cudnn_packed")
    with registry.assume_backend("gpu"):        # traced as for a GPU: the CUDA device itself is checked
        with pytest.raises(ImplementationUnavailable, match="cudnn_packed needs a CUDA GPU"):
            attention(q, k, k, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                      implementation="cudnn_packed")
        with pytest.raises(ImplementationUnavailable, match="T == S"):     # the flash contract is checked first
            attention(q, k[:, :8], k[:, :8], q_positions=pos, kv_positions=pos[:, :8], q_segment_ids=seg,
                      kv_segment_ids=seg[:, :8], implementation="cudnn_packed")
    with pytest.raises(ValueError, match="cudnn_packed needs a CUDA GPU"):     # the function itself
        cudnn_packed.packed_attention(q, k, k, seg)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (Hopper or newer)")
@pytest.mark.parametrize("n_docs,max_segments,overflow", [(3, 16, "flash"), (5, (2, 8), "flash"), (5, 2, "flash"),
                                                          (3, 8, "nan"), (5, 2, "nan"), (5, (2, 4), "nan")])
def test_device_cudnn_packed_matches_xla(n_docs, max_segments, overflow, capfd):
    """(5, 2, "flash"): the flash fallback runs; (5, 2, "nan") / (5, (2, 4), "nan"): NaN output."""
    rng = np.random.default_rng(2)
    b, t, h, g, d = 2, 640, 8, 2, 128
    rows = [_packed_row(rng, t, n_docs, 37), _packed_row(rng, t, n_docs, 0)]
    seg, pos = jnp.asarray(np.stack([r[0] for r in rows])), jnp.asarray(np.stack([r[1] for r in rows]))
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.bfloat16) for n in (h, g, g, h))

    def run(impl):
        def f(q, k, v):
            if impl == "cudnn_packed":
                return cudnn_packed.packed_attention(q, k, v, seg, max_segments=max_segments, overflow=overflow)
            return attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                             implementation=impl)

        def fb(q, k, v):
            o, pull = jax.vjp(f, q, k, v)
            return (o, *pull(do))
        return jax.jit(fb)(q, k, v)

    got, want = run("cudnn_packed"), run("xla")
    largest = max_segments if isinstance(max_segments, int) else max_segments[-1]
    if overflow == "nan" and n_docs + 1 > largest:
        assert np.isnan(np.asarray(got[0], np.float32)[np.asarray(seg) >= 0]).all()
        return
    for name, a, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert _rel(a, w) < 2e-2, (name, _rel(a, w))
    assert np.all(np.asarray(got[0], np.float32)[np.asarray(seg) < 0] == 0)
    printed = capfd.readouterr().out
    assert ("ran pallas_flash_gpu" in printed) == (n_docs + 1 > largest)
    clear_implementation_report()
    jax.jit(lambda q, k, v: attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                                      kv_segment_ids=seg, implementation="cudnn_packed")).trace(q, k, v)
    assert implementation_report()["attention"] == "cudnn_packed"


def test_auto_picks_cudnn_packed_where_it_runs(monkeypatch):
    """On a GPU, "auto" serves packed self-attention with cuDNN's packed layout where it is available
    (Hopper+, bf16/fp16), and with the flash kernel where not."""
    monkeypatch.setattr(cudnn_packed, "packed_attention", lambda q, k, v, seg: jnp.ones_like(q))
    monkeypatch.setattr(flash, "flash_attention", lambda q, k, v, seg, backend: jnp.zeros_like(q))
    q = jnp.ones((1, 32, 2, 16), jnp.bfloat16)
    k = jnp.ones((1, 32, 1, 16), jnp.bfloat16)
    pos, seg = jnp.arange(32)[None], jnp.zeros((1, 32), jnp.int32)
    call = lambda: attention(q, k, k, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                             implementation="auto")
    for available, want, value in ((True, "cudnn_packed", 1.0), (False, "pallas_flash_gpu", 0.0)):
        monkeypatch.setattr(cudnn_packed, "unavailable_reason", lambda q, ok=available: None if ok else "not here")
        clear_implementation_report()
        with registry.assume_backend("gpu"):
            out = call()
        assert implementation_report()["attention"] == want and float(out[0, 0, 0, 0]) == value


def _emulated_cudnn(calls):
    """A stand-in for JAX's private cuDNN entry point with the packed layout's meaning (attention causal
    inside each [offset, offset + seqlen) run, nothing outside the runs), printing the bound it got."""
    def dpa(q, k, v, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *, scale, mask_type, qkv_layout):
        assert bias is None and mask is None and qkv_layout == "BTNH" and k.shape == q.shape   # GQA repeated
        assert q_seqlen is kv_seqlen and q_offsets is kv_offsets
        calls.append(q_seqlen.shape[1])                            # at trace time: every bucket's branch
        jax.debug.print("emulated cudnn bound={m}", m=q_seqlen.shape[1])
        t = q.shape[1]
        idx = jnp.arange(t)
        off, n = q_offsets[:, :-1, None], q_seqlen[:, :, None]
        member = (idx >= off) & (idx < off + n) & (n > 0)             # [B, M, T]
        run = jnp.where(member.any(1), jnp.argmax(member, 1), -1)     # [B, T]
        vis = (run[:, :, None] == run[:, None, :]) & (run[:, :, None] >= 0) & (idx[None, :] <= idx[:, None])
        s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * scale
        s = jnp.where(vis[:, None], s, -jnp.inf)
        p = jnp.nan_to_num(jnp.exp(s - jnp.max(s, -1, keepdims=True)))
        p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
        return jnp.einsum("bhts,bshd->bthd", p, v.astype(jnp.float32)).astype(q.dtype)
    return dpa


@pytest.mark.parametrize("n_docs,pad,bounds,overflow,want", [
    (1, 0, (2, 8), "flash", "bound=2"), (3, 5, (2, 8), "flash", "bound=8"), (9, 5, (2, 8), "flash", "flash"),
    (9, 5, (2, 8), "nan", "nan"), (3, 0, 4, "nan", "bound=4"), (6, 0, 4, "nan", "nan")])
def test_bucket_switch_and_overflow_wiring(monkeypatch, capfd, n_docs, pad, bounds, overflow, want):
    """The op's own logic on a CPU, with cuDNN emulated: the smallest bucket that holds the most-packed
    row runs (printed by the stand-in), beyond the largest the flash kernel runs (interpret mode here) or
    NaN comes back; every served call equals the XLA reference of the op's contract."""
    from jax._src.cudnn import fused_attention_stablehlo as fas

    calls = []
    monkeypatch.setattr(fas, "dot_product_attention", _emulated_cudnn(calls))
    monkeypatch.setattr(cudnn_packed, "unavailable_reason", lambda q: None)
    interp = flash.flash_attention
    monkeypatch.setattr(cudnn_packed.flash, "flash_attention",
                        lambda q, k, v, seg, backend: interp(q, k, v, seg, backend="gpu_interpret"))
    rng = np.random.default_rng(3)
    b, t, h, g, d = 2, 64, 4, 2, 16
    rows = [_packed_row(rng, t, n_docs, pad), _packed_row(rng, t, min(n_docs, 2), 0)]
    seg, pos = jnp.asarray(np.stack([r[0] for r in rows])), jnp.asarray(np.stack([r[1] for r in rows]))
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32) for n in (h, g, g))
    got = np.asarray(jax.jit(lambda q, k, v: cudnn_packed.packed_attention(
        q, k, v, seg, max_segments=bounds, overflow=overflow))(q, k, v))
    printed = capfd.readouterr().out
    assert sorted(set(calls)) == sorted({bounds} if isinstance(bounds, int) else set(bounds))
    if want == "nan":
        assert np.isnan(got[np.asarray(seg) >= 0]).all() and "pallas_flash" not in printed
        # one bound: cuDNN ran (no conditional) and its output was replaced; buckets: no branch ran cuDNN
        assert ("emulated cudnn" in printed) == isinstance(bounds, int)
        return
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg,
                                   kv_segment_ids=seg, implementation="xla"))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    if want == "flash":
        assert "ran pallas_flash_gpu" in printed and "emulated cudnn" not in printed
    else:
        assert f"emulated cudnn {want}" in printed and "pallas_flash" not in printed
        assert printed.count("emulated cudnn") == 1
