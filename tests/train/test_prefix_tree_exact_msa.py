"""Prefix-tree merging is exact for MSA too: on a tiny M3 model (a dense layer and an MSA layer, block 16,
top-4, so trajectories past 64 tokens are really sparse) the merged batch's loss, indexer KL and every
gradient equal those of the unmerged trajectories (fp32, 1e-5), with the sparse KL and the dense warm-up,
for trees of 1-6 levels with branch points inside and on 16-token blocks, several trees per row, a
trajectory that is a prefix of another, and a duplicate; both ways of running MSA on trees: tree
visibility in the XLA ops (``subtree_end`` + ``input_weight``) and the per-trajectory key layout
(``key_len``), the latter also through the Pallas GPU kernels (interpreted). Without tree visibility the MSA
layer would see sibling branches: that case differs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.data.prefix_tree import pack_trajectories
from minimax_jax.model import init_params
from minimax_jax.ops import registry
from minimax_jax.train.step import StepSpec, _loss_fn, batch_norms
from tests.train.test_prefix_tree_exact import _assert_grads_equal, _trajs, _tree, _value_and_grad
from tests.train.test_prefix_tree_exact import _unmerged as _unmerged_rows

VOCAB = 97


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_yaml("configs/tiny-m3.yaml").replace(
        vocab_size=VOCAB, num_layers=2, layer_types=("full", "msa"), mlp_types=("dense", "moe"), num_mtp_modules=0)
    assert cfg.index_block_size == 16 and cfg.index_topk == 4
    return cfg, init_params(cfg, jax.random.key(1))


def _unmerged(trajs):
    """The reference: one trajectory per row; padding in segment -1 (no key visible: no KL row)."""
    return _unmerged_rows(trajs, pad_segment=-1)


def _run(cfg, params, batch, kl_mode):
    registry.clear_implementation_report()
    loss, m, _, g = _value_and_grad(StepSpec(cfg=cfg, z_loss=1e-3, kl_mode=kl_mode, kl_coeff=0.5), params, batch)
    return loss, float(m["indexer_kl"]), g


CASES = {
    # name: (tree specs, seq_len, rows, kl mode)
    "one_level_sparse": ([(90, [])], 96, 1, "sparse"),
    "inside_block": ([(37, [(50, []), (45, []), (11, [])])], 256, 1, "sparse"),
    "on_block_16_and_64": ([(64, [(30, []), (16, [(40, []), (12, [])])])], 256, 1, "sparse"),
    "six_levels": ([(10, [(16, [(8, [(32, [(6, [(25, []), (4, [])]), (6, [])]), (3, [])]), (5, [])]), (2, [])])],
                   192, 1, "sparse"),
    "several_trees_per_row": ([(12, [(60, []), (7, [])]), (15, [(3, []), (40, [])]), (20, [])], 128, 2, "sparse"),
    "dense_warmup": ([(48, [(40, []), (33, [(17, []), (9, [])])])], 256, 1, "dense"),
}


WAYS = [(name, "ops_xla") for name in sorted(CASES)] + \
       [(name, "keys_xla") for name in ("six_levels", "several_trees_per_row", "dense_warmup")] + \
       [("several_trees_per_row", "keys_pallas"),
        # slow: this tree's ops_xla way is in the default run, the key layout through the kernels above
        pytest.param("on_block_16_and_64", "keys_pallas", marks=pytest.mark.slow, id="on_block_16_and_64-keys_pallas"),
        ("several_trees_per_row", "keys_tpu_kernels")]


@pytest.fixture(scope="module")
def references() -> dict:
    """The unmerged reference of each case, computed once: the ways of one case share it (same trajectories,
    model, KL mode; the reference always runs the XLA ops)."""
    return {}


def _case_trajectories(name: str) -> tuple[list, list]:
    """Case ``name``'s ``(token lists, trajectories)`` (seeded by the name)."""
    rng = np.random.default_rng(len(name) + 3)
    tokens = [t for s in CASES[name][0] for t in _tree(rng, s)]
    if name == "several_trees_per_row":   # a prefix of another trajectory and a duplicate
        tokens += [tokens[0][:30], list(tokens[1])]
    return tokens, _trajs(rng, tokens)


@pytest.mark.parametrize("name,way", WAYS)
def test_msa_merged_loss_kl_and_grads_equal_unmerged(model, references, name, way):
    cfg, params = model
    specs, seq_len, rows, kl_mode = CASES[name]
    tokens, trajs = _case_trajectories(name)
    # key_len 2 * seq_len: every case's unmerged trajectories fit, with padding left in each row (the
    # interpreted kernels' time grows with the key length)
    packed, stats = pack_trajectories(trajs, seq_len, rows, key_len=None if way == "ops_xla" else 2 * seq_len)
    assert stats.tokens_after < stats.tokens_before or len(tokens) == 1
    assert max(t.tokens.size for t in trajs) > cfg.index_topk * cfg.index_block_size   # really sparse
    if name not in references:
        references[name] = _run(cfg, params, _unmerged(trajs), kl_mode)
    l_ref, kl_ref, g_ref = references[name]
    impl = {"keys_pallas": "pallas_gpu_interpret", "keys_tpu_kernels": "pallas_tpu_interpret"}.get(way, "xla")
    cfg = cfg.replace(msa_impl=impl)
    l_tree, kl_tree, g_tree = _run(cfg, params, packed, kl_mode)
    ran = registry.implementation_report()
    # the GPU KL kernels take the merged queries with weights; the TPU ones the gathered unmerged rows
    assert ran["msa_attention" if kl_mode == "sparse" else "indexer_kl"] == impl
    assert kl_ref > 0
    np.testing.assert_allclose(kl_tree, kl_ref, rtol=1e-5)
    np.testing.assert_allclose(l_tree, l_ref, rtol=1e-5)
    _assert_grads_equal(g_ref, g_tree)
    idx = g_ref["segments"][1]["attn"]["index_q_proj"] if "segments" in g_ref else None
    assert idx is None or np.abs(np.asarray(idx)).max() > 0     # the KL really trains the indexer


def test_msa_without_tree_visibility_or_weights_differs(model, references):
    """The tree inputs matter: dropping ``subtree_end`` (siblings leak into MSA scores and attention) or
    ``input_weight`` (shared prefixes counted once in the KL) changes the result. The "inside_block" case's
    trees (its merged and unmerged programs, and its reference, shared with that case's test above)."""
    cfg, params = model
    name = "inside_block"
    specs, seq_len, rows, kl_mode = CASES[name]
    _, trajs = _case_trajectories(name)
    packed, _ = pack_trajectories(trajs, seq_len, rows)
    l_tree, kl_tree, _ = _run(cfg, params, packed, kl_mode)
    if name not in references:
        references[name] = _run(cfg, params, _unmerged(trajs), kl_mode)
    l_ref, kl_ref, _ = references[name]
    np.testing.assert_allclose(kl_tree, kl_ref, rtol=1e-5)
    blind = {k: v for k, v in packed.items() if k != "subtree_end"}
    assert abs(_run(cfg, params, blind, "sparse")[0] - l_ref) > 1e-4 * abs(l_ref)
    unweighted = {k: v for k, v in packed.items() if k != "input_weight"}
    assert abs(_run(cfg, params, unweighted, "sparse")[1] - kl_ref) > 1e-4 * abs(kl_ref)


def test_gpu_lowering_runs_the_kernels_on_tree_rows(model):
    """Traced as on a GPU and lowered for CUDA (nothing runs): with the key layout the MSA layer's ops and
    the KL resolve to the Pallas kernels and the dense layer to the tree attention kernel."""
    cfg, params = model
    cfg = cfg.replace(dtype="bfloat16")
    rng = np.random.default_rng(5)
    trajs = _trajs(rng, _tree(rng, (40, [(50, []), (45, [])])))
    packed, _ = pack_trajectories(trajs, 256, 1, key_len=512)
    spec = StepSpec(cfg=cfg, kl_mode="sparse")
    batch = {k: jnp.asarray(v) for k, v in packed.items()}
    fn = jax.jit(jax.value_and_grad(_loss_fn(spec, jax.tree.map(lambda _: True, params)), has_aux=True))
    registry.clear_implementation_report()
    with registry.assume_backend("gpu"):
        txt = fn.trace(params, batch, batch_norms(batch, 0)).lower(lowering_platforms=("cuda",)).as_text()
    ran = registry.implementation_report()
    assert ran["attention"] == "pallas_tree_gpu"
    assert ran["msa_attention"] in ("pallas_gpu", "pallas_hopper_gpu") and ran["indexer_kl"] == "pallas_gpu"
    assert ran["msa_select_blocks"] in ("pallas_gpu", "pallas_hopper_gpu")
    assert txt.count("__gpu$xla.gpu.triton") >= 5


def test_eval_step_on_key_layout_rows_equals_unmerged(model):
    """``make_eval_step`` (no KL) on prefix-tree rows with the key layout: the CE sum and the token count
    equal the unmerged batch's (the evaluation of a ``data.key_len`` run)."""
    from minimax_jax.train.step import make_eval_step

    cfg, params = model
    rng = np.random.default_rng(5)
    trajs = _trajs(rng, _tree(rng, (40, [(50, []), (45, [(20, []), (9, [])])])))
    packed, _ = pack_trajectories(trajs, 256, 1, key_len=512)
    step = jax.jit(make_eval_step(cfg))
    ce_tree, n_tree = step(params, {k: jnp.asarray(v) for k, v in packed.items()})
    ce_ref, n_ref = step(params, {k: jnp.asarray(v) for k, v in _unmerged(trajs).items()})
    assert float(n_tree) == float(n_ref) > 0
    np.testing.assert_allclose(float(ce_tree), float(ce_ref), rtol=1e-5)
