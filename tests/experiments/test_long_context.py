"""Issue 31's long-row recipe (experiments/long_context/): the shipped MSA model as a dense model keeps its
backbone exactly, the device script parses, and summarize.py reads long_stage.sh's metrics files."""

import json
import subprocess
import sys

import numpy as np

from tests.paths import REPO_ROOT


def test_dense_from_msa_keeps_the_backbone(tmp_path):
    """Every msa layer becomes full, index leaves are gone, and at 500 tokens (below top-8 x 64-token blocks, so
    MSA attends to every block) the dense copy's logits equal the MSA model's."""
    import jax.numpy as jnp

    from minimax_jax.convert.load import load_checkpoint
    from minimax_jax.model import forward

    dst = tmp_path / "dense"
    r = subprocess.run([sys.executable, "experiments/long_context/dense_from_msa.py", "--src", "checkpoints/demo",
                        "--dst", str(dst)], capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    c_msa, p_msa = load_checkpoint(f"{REPO_ROOT}/checkpoints/demo", dtype="float32")
    c_dense, p_dense = load_checkpoint(dst, dtype="float32")
    assert c_msa.has_msa and not c_dense.has_msa and set(c_dense.layer_types) == {"full"}
    assert any("index_" in k for k in jax_paths(p_msa)) and not any("index_" in k for k in jax_paths(p_dense))
    assert (dst / "tokenizer.json").is_file()
    assert c_msa.index_block_size * c_msa.index_topk >= 500
    toks = jnp.asarray(np.random.default_rng(0).integers(3, 2000, (1, 500)), jnp.int32)
    a = forward(p_msa, c_msa.replace(dtype="float32"), toks).logits
    b = forward(p_dense, c_dense.replace(dtype="float32"), toks).logits
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-4, rtol=0)


def jax_paths(params):
    import jax

    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def test_device_script_is_valid_bash():
    r = subprocess.run(["bash", "-n", "experiments/long_context/device.sh"], capture_output=True, text=True,
                       cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr


def test_summarize_reads_long_stage_metrics(tmp_path):
    sys.path.insert(0, f"{REPO_ROOT}/experiments/three_way")
    import summarize

    rows = [{"step": 50, "lm_loss": 3.0, "tokens": 1000.0, "tokens_per_s": 10.0, "lr": 1e-3},
            {"step": 100, "lm_loss": 2.0, "tokens": 1000.0, "tokens_per_s": 30.0, "lr": 5e-4}]
    with open(tmp_path / "metrics_long_full.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "train_full.log").write_text("train.py: preempted at step 80: checkpoint saved\n")
    table = summarize.training_summary(str(tmp_path))
    assert "| full | 80 |" in table and "3.00 (50)" in table and "2.00 (100)" in table


def test_needle_ranks_block_scores_match_a_direct_computation():
    """needle_ranks.block_scores: the head-averaged softmax mass per block and the per-block max index score of the
    last query, against numpy loops (a ragged last block included)."""
    import jax.numpy as jnp

    sys.path.insert(0, f"{REPO_ROOT}/experiments/long_context")
    from needle_ranks import block_scores

    rng = np.random.default_rng(1)
    t, g, r, d, di, bs = 37, 2, 3, 8, 4, 8
    q, k = rng.normal(size=(g * r, d)), rng.normal(size=(t, g, d))
    qi, ki = rng.normal(size=(g, di)), rng.normal(size=(t, di))
    nb = -(-t // bs)
    mass, idx = block_scores(*(jnp.asarray(a, jnp.float32) for a in (q, k, qi, ki)), nb, bs)
    for gg in range(g):
        p = np.zeros(t)
        for h in range(gg * r, gg * r + r):
            s = k[:, gg] @ q[h] / np.sqrt(d)
            p += np.exp(s - s.max()) / np.exp(s - s.max()).sum() / r
        si = ki @ qi[gg]
        for b in range(nb):
            np.testing.assert_allclose(mass[gg, b], p[b * bs:(b + 1) * bs].sum(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(idx[gg, b], si[b * bs:(b + 1) * bs].max(), rtol=1e-5, atol=1e-5)
