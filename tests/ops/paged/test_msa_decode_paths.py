"""``msa_decode``'s dense path: rows whose context fits in K x B tokens select every page, so no scoring runs.

Dispatch boundaries (contexts of K*B - 1, K*B, K*B + 1 tokens, mixed batches with one long row,
padding rows), Q in {1, 8}, float32 and fp8 caches, eager and jitted (``jax.lax.cond``), each
against the XLA reference composition (``xla.msa_decode_select`` then sparse ``xla.paged_attention``)
every element, block ids compared as sets; the dense branch does no scoring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.ops import paged as ops
from minimax_jax.ops.paged import api
from minimax_jax.ops.paged import xla as ref
from minimax_jax.ops.registry import clear_implementation_report, implementation_report
from minimax_jax.decode.cache import quantize
from tests.ops.paged.test_decode_oracle import D, DI, G, HG, K, PAGE

KB = K * PAGE


def _case(nq, contexts, dtype="float32", npg=12):
    """Row i of request b at position ``contexts[b] - nq + i`` (context = tokens incl. the new rows);
    ``None`` = a request of padding rows only. Shuffled page tables; random caches."""
    rng = np.random.default_rng(0)
    b, p = len(contexts), len(contexts) * npg + 1
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    (k, ks), (v, vs), (ki, kis) = (quantize(x, dtype) for x in (f(G, p, PAGE, D), f(G, p, PAGE, D), f(p, PAGE, DI)))
    pos = [[-1] * nq if n is None else [n - nq + i for i in range(nq)] for n in contexts]
    return dict(q=f(b, nq, G * HG, D), qi=f(b, nq, G, DI), k=k, v=v, ki=ki, k_scale=ks, v_scale=vs, ki_scale=kis,
                table=jnp.asarray(rng.permutation(np.arange(1, p)).reshape(b, npg), jnp.int32),
                pos=jnp.asarray(pos, jnp.int32))


def _args(c):
    return (c["q"], c["qi"], c["k"], c["v"], c["ki"], c["table"], c["pos"], c["k_scale"], c["v_scale"],
            c["ki_scale"])


def _op(impl="xla", runtime=True):
    def f(q, qi, k, v, ki, table, pos, k_scale, v_scale, ki_scale):
        return ops.msa_decode(q, qi, k, v, ki, table, pos, k_scale=k_scale, v_scale=v_scale, ki_scale=ki_scale,
                              topk=K, implementation=impl, runtime_dense_check=runtime)
    return f


def _reference(c):
    ids = ref.msa_decode_select(c["qi"], c["ki"], c["table"], c["pos"], ki_scale=c["ki_scale"], topk=K,
                                init_blocks=0, local_blocks=1)
    o, lse = ref.paged_attention(c["q"], c["k"], c["v"], c["table"], c["pos"], k_scale=c["k_scale"],
                                 v_scale=c["v_scale"], block_ids=ids, sliding_window=None)
    return np.asarray(o), np.asarray(lse), np.asarray(ids)


def _check(c, got, tol=1e-5):
    o, lse, ids = (np.asarray(x) for x in got)
    want_o, want_lse, want_ids = _reference(c)
    assert o.shape == want_o.shape and o.dtype == want_o.dtype and lse.dtype == np.float32
    assert ids.shape == want_ids.shape and ids.dtype == np.int32
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(want_ids, -1))
    np.testing.assert_allclose(o, want_o, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], atol=tol, rtol=tol)


@pytest.mark.parametrize("nq", [1, 8])
@pytest.mark.parametrize("contexts,path", [((KB - 1, KB - 1), "dense"), ((KB, 20), "dense"),
                                           ((KB + 1, KB), "sparse"), ((KB, 150), "sparse"),
                                           ((KB, None), "dense"), ((None, KB + 1), "sparse")])
def test_boundaries_match_reference_eager_and_jit(nq, contexts, path):
    c = _case(nq, contexts)
    clear_implementation_report()
    _check(c, _op()(*_args(c)))
    assert implementation_report()["msa_decode.path"] == path
    clear_implementation_report()
    _check(c, jax.jit(_op())(*_args(c)))
    assert implementation_report()["msa_decode.path"] == "cond"
    clear_implementation_report()                           # default under jit: no run-time branch
    assert "cond" not in str(jax.make_jaxpr(_op(runtime=False))(*_args(c)))
    _check(c, jax.jit(_op(runtime=False))(*_args(c)))
    assert implementation_report()["msa_decode.path"] == "sparse"


@pytest.mark.parametrize("contexts", [(KB, KB - 3), (KB + 1, 30)])
def test_fp8_caches_and_index_keys(contexts):
    c = _case(8, contexts, dtype="float8_e4m3fn")
    assert c["ki_scale"] is not None
    _check(c, _op()(*_args(c)))
    _check(c, jax.jit(_op())(*_args(c)))


def test_static_dense_when_the_page_table_fits_topk():
    c = _case(8, (KB, 40, None), npg=K)
    clear_implementation_report()
    jaxpr = str(jax.make_jaxpr(_op())(*_args(c)))
    assert "cond" not in jaxpr and "top_k" not in jaxpr
    assert implementation_report()["msa_decode.path"] == "dense" and "msa_decode_select" not in implementation_report()
    _check(c, jax.jit(_op())(*_args(c)))


def test_dense_branch_does_no_scoring(monkeypatch):
    calls = []
    select = api.msa_decode_select
    monkeypatch.setattr(api, "msa_decode_select", lambda *a, **kw: calls.append(1) or select(*a, **kw))
    short, long = _case(8, (KB, KB - 9)), _case(8, (KB + 1, KB))
    _op()(*_args(short))
    assert calls == []                                      # eager, all rows short: no selection at all
    _op()(*_args(long))
    assert calls == [1]
    jaxpr = jax.make_jaxpr(_op())(*_args(short)).jaxpr
    (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    sparse_branch, dense_branch = (str(b) for b in cond.params["branches"])   # lax.cond: (false, true)
    assert "top_k" in sparse_branch and "top_k" not in dense_branch


def test_kernel_implementation_under_cond():
    """Both branches through the TPU kernels (interpret mode): equal shapes/dtypes, the reference result."""
    for contexts in ((KB, 33), (KB + 1, 33)):
        c = _case(2, contexts)
        _check(c, jax.jit(_op("pallas_tpu_interpret"))(*_args(c)), tol=1e-4)


def test_shapes_checked_on_the_dense_path():
    c = _case(1, (20, 20), npg=K)
    a = list(_args(c))
    with pytest.raises(ValueError, match="index heads"):
        _op()(*a[:1], a[1][:, :, :1], *a[2:])
    with pytest.raises(ValueError, match="qi must be"):
        _op()(*a[:4], a[4][..., :-1], *a[5:])
