"""Split decoder layers (``minimax_jax.model.params.split_layers``, what ``load_model`` gives inference): the same
values as the stacked segments, ``forward`` and the decode engine give the same results from either layout, the
stacked arrays can be deleted as they are split, shardings lose only the layer axis, and the decode step reports
which layout it read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.decode import DecodeEngine
from minimax_jax.decode.step import LAYERS_REPORT
from minimax_jax.model import forward, layers_layout, split_layers, stack_layers, unstack_layers
from minimax_jax.model.params import init_params, is_split, layer_segments
from minimax_jax.ops.registry import clear_implementation_report, implementation_report


def _m3(num_layers=3):
    """float32 tiny M3: a dense layer, then MSA + MoE layers (segments of 1 and num_layers - 1 layers)."""
    cfg = ModelConfig.from_yaml("configs/tiny-m3.yaml").replace(
        num_layers=num_layers, layer_types=("full",) + ("msa",) * (num_layers - 1),
        mlp_types=("dense",) + ("moe",) * (num_layers - 1), num_mtp_modules=0, dtype="float32",
        param_dtype="float32")
    return cfg, init_params(cfg, jax.random.key(3))


def _same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_split_keeps_values_and_round_trips():
    cfg, params = _m3()
    split = split_layers(params, cfg)
    assert [len(sp) for sp in split["segments"]] == [s.length for s in layer_segments(cfg)] == [1, 2]
    assert layers_layout(split) == "split" and layers_layout(params) == "stacked"
    assert all(is_split(sp) for sp in split["segments"]) and not any(is_split(sp) for sp in params["segments"])
    assert layers_layout({**params, "segments": [split["segments"][0], params["segments"][1]]}) == "mixed"
    _same(unstack_layers(split, cfg), unstack_layers(params, cfg))
    _same(stack_layers(unstack_layers(split, cfg), cfg), params["segments"])
    _same(split_layers(split, cfg), split)                      # idempotent
    assert split["embed"] is params["embed"]                    # the rest is shared, not copied
    for lp in split["segments"][1]:                             # each layer's leaves are their own buffers
        assert lp["mlp"]["wi"].shape == params["segments"][1]["mlp"]["wi"].shape[1:]


def test_delete_stacked_frees_the_stacked_arrays():
    cfg, params = _m3()
    want = jax.tree.map(np.asarray, unstack_layers(params, cfg))
    stacked = jax.tree.leaves(params["segments"])
    split = split_layers(params, cfg, delete_stacked=True)
    assert all(x.is_deleted() for x in stacked)
    assert not any(x.is_deleted() for x in jax.tree.leaves(split))
    _same(unstack_layers(split, cfg), want)


def test_split_keeps_shardings_without_the_layer_axis():
    cfg, params = _m3()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    P = jax.sharding.PartitionSpec
    wi = params["segments"][1]["mlp"]["wi"]                     # [L, E, H, 2I]
    placed = {**params, "segments": [params["segments"][0], {**params["segments"][1], "mlp": {
        **params["segments"][1]["mlp"], "wi": jax.device_put(wi, jax.sharding.NamedSharding(mesh, P(None, "x")))}}]}
    split = split_layers(placed, cfg)
    for lp in split["segments"][1]:
        assert lp["mlp"]["wi"].sharding.spec == P("x", None, None)


def test_forward_is_the_same_from_either_layout():
    cfg, params = _m3()
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 48)), jnp.int32)
    run = jax.jit(lambda p: forward(p, cfg, tokens, return_msa=True, indexer_kl="sparse"))
    a, b = run(params), run(split_layers(params, cfg))
    np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), rtol=1e-6, atol=1e-6)
    assert jax.tree.structure(a.aux) == jax.tree.structure(b.aux) and "msa" in a.aux
    for x, y in zip(jax.tree.leaves(a.aux), jax.tree.leaves(b.aux)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=1e-6)


def test_decode_engine_reads_either_layout():
    cfg, params = _m3()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (40, 23)]
    runs = {}
    for name, p in (("stacked", params), ("split", split_layers(params, cfg))):
        jax.clear_caches()                  # the report is written when the step is traced
        clear_implementation_report()
        eng = DecodeEngine(p, cfg, max_seqs=2, max_len=96, prefill_chunk=16, implementation="xla",
                           prefill_implementation="xla")
        slots, logits = eng.prefill(prompts)
        first = np.array([int(np.argmax(lg[-1])) for lg in logits])
        runs[name] = (np.stack([lg[-1] for lg in logits]), eng.decode_greedy(first, slots, 5))
        assert implementation_report()[LAYERS_REPORT].startswith(name)
    np.testing.assert_allclose(runs["split"][0], runs["stacked"][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(runs["split"][1], runs["stacked"][1])


def test_load_model_gives_split_layers():
    from minimax_jax.infer import load_model

    m = load_model(None, log=lambda _: None)                   # the shipped demo checkpoint
    assert layers_layout(m.params) == "split"
    assert [len(sp) for sp in m.params["segments"]] == [s.length for s in layer_segments(m.cfg)]
