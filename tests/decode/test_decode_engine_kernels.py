"""Model level: decode steps through the TPU decode kernels (interpret mode) equal ``forward``.

(The GPU kernels run the same selection/attention contract; they are checked op by op in
tests/kernels/decode/test_decode_kernels_gpu.py with "pallas_gpu_interpret".)
"""

from __future__ import annotations


def test_engine_decode_with_tpu_kernels_matches_forward():
    """Two sequences (100 and 50 tokens: sparse and dense regimes), Q=3 rows, shuffled pages."""
    import numpy as np

    from minimax_jax.decode import DecodeEngine
    from minimax_jax.ops.registry import clear_implementation_report, implementation_report
    from tests.decode.test_decode_fixtures import assert_close, random_tokens, reference_logits, small_model

    cfg, params = small_model("m3")
    rng = np.random.default_rng(0)
    eng = DecodeEngine(params, cfg, max_seqs=2, max_len=112, prefill_chunk=48, implementation="pallas_tpu_interpret")
    eng.pool.shuffle(int(rng.integers(1 << 30)))
    full = [random_tokens(rng, cfg, 100), random_tokens(rng, cfg, 50)]
    slots, _ = eng.prefill([f[:-3] for f in full])
    clear_implementation_report()
    out = eng.decode_step(np.array([f[-3:] for f in full]), slots)
    rep = implementation_report()
    assert rep["msa_decode_select"] == rep["paged_attention"] == "pallas_tpu_interpret"
    assert rep["msa_decode_select.topk"] == "xla"
    for i, f in enumerate(full):
        assert_close(out[i], reference_logits(cfg, params, f)[-3:])
