"""infer.py's default prefill chunk follows the prompt length on a GPU and stays small elsewhere."""

from minimax_jax.infer.backends import PREFILL_CHUNK_MAX, PREFILL_CHUNK_MIN, auto_prefill_chunk


def test_gpu_chunk_follows_prompt_length():
    assert auto_prefill_chunk(1000, "gpu") == PREFILL_CHUNK_MIN == 256
    assert auto_prefill_chunk(131072, "gpu") == PREFILL_CHUNK_MAX == 16384
    assert auto_prefill_chunk(1 << 20, "gpu") == 16384
    assert auto_prefill_chunk(40000, "gpu") == 5000


def test_cpu_and_tpu_keep_small_chunks():
    assert auto_prefill_chunk(1 << 20, "cpu") == 256
    assert auto_prefill_chunk(1 << 20, "tpu") == 256
    assert auto_prefill_chunk(10) == 256             # this machine's backend (CPU in CI)
