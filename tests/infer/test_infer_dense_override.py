"""``--attention dense``: an MSA checkpoint run with full causal attention in its MSA layers.

Checks: the override's params fit the all-"full" config exactly (tree, shapes, dtypes, MTP too);
its logits equal the same MSA model whose top-k covers every block (then MSA *is* dense attention),
both when segments keep their boundaries and when two segments merge; unknown modes fail with a
clear error (API, loader before any work, CLI flag); the flag is in ``infer.py --help``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.config import ModelConfig
from minimax_jax.infer.attention_mode import (ATTENTION_MODES, INDEX_PARAM_NAMES, apply_attention_mode,
                                              describe_attention_mode)
from minimax_jax.model import abstract_params
from minimax_jax.model.transformer import forward, mtp_forward

T = 64          # tokens; 4 blocks of 16


def _cfg(layer_types, mlp_types, topk=4):
    return ModelConfig(vocab_size=128, hidden_size=32, num_layers=len(layer_types), num_heads=4, num_kv_heads=2,
                       head_dim=8, rotary_dim=4, max_position_embeddings=256, norm_kind="gemma", qk_norm="per_head",
                       layer_types=tuple(layer_types), mlp_types=tuple(mlp_types), mlp_activation="swigluoai",
                       dense_intermediate_size=48, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_intermediate_size=16, index_head_dim=8, index_block_size=16, index_topk=topk,
                       num_mtp_modules=1, dtype="float32", param_dtype="float32", attention_impl="xla",
                       moe_impl="xla_dense", msa_impl="xla")


def _forward(params, cfg, toks, hidden=False):
    return jax.jit(forward, static_argnames=("cfg", "return_hidden"))(params, cfg, toks, return_hidden=hidden)


def _mtp(params, cfg, hidden, toks):
    return jax.jit(mtp_forward, static_argnames=("cfg",))(params, cfg, hidden, toks)


def _init(cfg, seed=0):
    """Random params of ``cfg`` from numpy (``init_params`` is slow on a CPU; values only need to be generic)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray((0.1 * rng.standard_normal(a.shape)).astype(a.dtype)),
                        abstract_params(cfg))


def _tokens():
    return jax.random.randint(jax.random.key(1), (2, T), 0, 128, jnp.int32)


def _same_structure(a, b):
    sa = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), a)
    sb = jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), b)
    assert jax.tree.structure(sa) == jax.tree.structure(sb)
    assert jax.tree.leaves(sa) == jax.tree.leaves(sb)


@pytest.mark.parametrize("layer_types,mlp_types,merges", [
    (("full", "msa", "msa"), ("dense", "moe", "moe"), False),     # M3 pattern: boundaries stay
    (("msa", "full", "msa"), ("moe", "moe", "moe"), True),        # all three layers become one segment
])
def test_dense_override_equals_msa_with_every_block_selected(layer_types, mlp_types, merges):
    cfg = _cfg(layer_types, mlp_types, topk=T // 16)   # top-k covers all 4 blocks: MSA == dense attention
    params = _init(cfg)
    dcfg, dparams = apply_attention_mode(cfg, params, "dense")
    assert dcfg.layer_types == tuple("full" for _ in layer_types)
    assert dcfg.replace(layer_types=cfg.layer_types) == cfg          # nothing else changed
    assert (len(dparams["segments"]) < len(params["segments"])) == merges
    _same_structure(dparams, abstract_params(dcfg))
    assert not any(n in m["layer"]["attn"] for m in dparams["mtp"] for n in INDEX_PARAM_NAMES)
    toks = _tokens()
    ref = _forward(params, cfg, toks, True)
    got = _forward(dparams, dcfg, toks, True)
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(ref.logits), rtol=2e-5, atol=2e-5)
    ref_mtp = _mtp(params, cfg, ref.hidden, toks)
    got_mtp = _mtp(dparams, dcfg, got.hidden, toks)
    np.testing.assert_allclose(np.asarray(got_mtp[0]), np.asarray(ref_mtp[0]), rtol=2e-5, atol=2e-5)


def test_dense_override_differs_from_sparse_msa_and_matches_full_config():
    cfg = _cfg(("full", "msa", "msa"), ("dense", "moe", "moe"), topk=2)   # genuinely sparse at T=64
    params = _init(cfg)
    dcfg, dparams = apply_attention_mode(cfg, params, "dense")
    full_cfg = cfg.replace(layer_types=("full",) * 3)
    assert dcfg == full_cfg
    toks = _tokens()
    sparse = np.asarray(_forward(params, cfg, toks).logits)
    dense = np.asarray(_forward(dparams, dcfg, toks).logits)
    assert np.abs(sparse - dense).max() > 1e-4           # the override really changed the attention
    # Same weights put into the all-full config by hand (index leaves removed) give identical logits.
    manual = jax.tree.map(lambda x: x, params)
    for sp in manual["segments"]:
        for n in INDEX_PARAM_NAMES:
            sp["attn"].pop(n, None)
    for m in manual["mtp"]:
        for n in INDEX_PARAM_NAMES:
            m["layer"]["attn"].pop(n, None)
    np.testing.assert_array_equal(np.asarray(_forward(manual, full_cfg, toks).logits), dense)


def test_as_trained_and_models_without_msa_are_unchanged():
    cfg = _cfg(("full", "msa"), ("dense", "moe"))
    params = _init(cfg)
    assert apply_attention_mode(cfg, params, "as_trained") == (cfg, params)
    full = cfg.replace(layer_types=("full", "full"))
    fparams = _init(full)
    c, p = apply_attention_mode(full, fparams, "dense")
    assert c is full and p is fparams
    assert "unchanged" in describe_attention_mode(full, "dense")
    assert "1 MSA layers" in describe_attention_mode(cfg, "dense")
    assert "1 full, 1 msa" in describe_attention_mode(cfg, "as_trained")


def test_unknown_mode_is_a_clear_error():
    cfg = _cfg(("full", "msa"), ("dense", "moe"))
    with pytest.raises(ValueError, match=r"attention mode must be one of \('as_trained', 'dense'\), got 'sparse'"):
        apply_attention_mode(cfg, {}, "sparse")
    from minimax_jax.infer.loading import load_model

    with pytest.raises(ValueError, match="attention mode must be one of"):   # before touching the checkpoint
        load_model("/nonexistent/checkpoint", attention="full")
    assert ATTENTION_MODES == ("as_trained", "dense")


def _infer(capsys, *args) -> tuple[int, str, str]:
    """``infer.py ARGS`` in this process (``minimax_jax.infer.cli.main``, all that infer.py calls; argparse's
    --help and refusals end in SystemExit): ``(exit status, stdout, stderr)``."""
    from minimax_jax.infer import cli

    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_flag_in_help_and_bad_value_rejected(capsys):
    code, out, _ = _infer(capsys, "--help")
    assert code == 0 and "--attention {as_trained,dense}" in out
    code, _, err = _infer(capsys, "--prompt=x", "--attention=sparse")
    assert code != 0
    assert code == 2 and "argument --attention: invalid choice: 'sparse'" in err
