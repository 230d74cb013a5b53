"""bench/msa_decode.py sweep helpers, its --sweep-scores and --serving CLIs and bench/decode_ncu.py plumbing (CPU,
kernels in interpret mode)."""

from tests.paths import REPO_ROOT
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = REPO_ROOT
sys.path.insert(0, os.path.join(ROOT, "bench"))

import msa_decode  # noqa: E402
import msa_decode_serving  # noqa: E402


@pytest.mark.parametrize("steps,reps,unroll", [(8, 3, 4), (10, 3, 4), (6, 2, 0), (4, 1, 8)])
def test_timed_steps_loop_equals_unrolled(steps, reps, unroll):
    """``unrolled``'s fori_loop (``unroll`` steps per iteration, a remainder included) sums the same steps, each
    with its own query and table replica, as the fully unrolled call."""
    import jax.numpy as jnp
    rng = np.random.default_rng(steps * 10 + reps)
    q, qi = jnp.asarray(rng.normal(size=(steps, 3))), jnp.asarray(rng.normal(size=(steps, 2)))
    x, tables = jnp.asarray(rng.normal(size=(4,))), jnp.asarray(rng.normal(size=(reps, 4)))
    fn = lambda q, qi, x, t: jnp.sum(q) * jnp.sum(qi) + jnp.dot(x, t)
    want = sum(float(fn(q[r], qi[r], x, tables[r % reps])) for r in range(steps))
    got = float(msa_decode.unrolled(fn, steps, reps, unroll=unroll)(q, qi, x, tables))
    assert abs(got - want) <= 1e-4 * max(1.0, abs(want))


@pytest.mark.parametrize("unroll", [4, 0])
def test_timed_steps_chain_attention_outputs(unroll):
    """A step returning an output of the queries' shape feeds it to the next step (``q[r + 1] + _CHAIN * o``):
    every element of every step's output is needed, and the call returns the last output's first element."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(5)
    steps, reps = 6, 2
    q = jnp.asarray(rng.normal(size=(steps, 2, 3)), jnp.float32)
    qi = jnp.asarray(rng.normal(size=(steps, 2)), jnp.float32)
    tables = jnp.asarray(rng.normal(size=(reps, 3)), jnp.float32)
    fn = lambda q, qi, t: jnp.tanh(q * t[None, :] + jnp.sum(qi)) * 1e31      # outputs large: the chain shows
    prev, want = jnp.zeros((2, 3), jnp.float32), None
    for r in range(steps):
        prev = fn(q[r] + prev * msa_decode._CHAIN, qi[r], tables[r % reps])
    want = float(prev[0, 0])
    run = msa_decode.unrolled(fn, steps, reps, unroll=unroll)
    assert abs(float(run(q, qi, tables)) - want) <= 1e-5 * abs(want)
    unchained = fn(q[-1], qi[-1], tables[(steps - 1) % reps])[0, 0]
    assert abs(float(unchained) - want) > 1e-3 * abs(want)      # the previous output did enter the last step
    text = jax.jit(lambda *a: run(*a)).lower(q, qi, tables).as_text()
    assert "while" in text if unroll else "while" not in text


def test_score_candidate_families():
    from pallas_kernels.decode import gpu_config
    wide, narrow = msa_decode.score_candidates("bf16"), msa_decode.score_candidates("bf16", "narrow")
    assert {c["num_warps"] for c in wide} == {4} and {c["num_warps"] for c in narrow} == {1, 2}
    fp8 = msa_decode.score_candidates("fp8", "narrow")
    assert len(fp8) == len(narrow) and all(c["f16"] for c in fp8)
    assert len(msa_decode.score_candidates("fp8")) == 2 * len(wide)     # with and without the f16 product
    pers = msa_decode.score_candidates("fp8", "persistent", sms=10)
    assert {c["programs"] for c in pers} == {10, 20, 40} and {c["num_warps"] for c in pers} == {1, 2, 4}
    assert len(pers) == 27 and all(c["f16"] and c["unroll"] == 1 for c in pers)
    ev = msa_decode.score_candidates("bf16", "evict", sms=10)
    assert all(c["evict"] == "evict_first" for c in ev) and {c.get("programs") for c in ev} == {0, 20}
    for e in gpu_config.DEFAULT_TABLE.score["bf16"].values():                    # the table's entries, streamed
        assert dict(gpu_config.SCORE_LAUNCH_BASE, **e, evict="evict_first") in ev
    import dataclasses
    mine = dataclasses.replace(gpu_config.DEFAULT_TABLE, score={"bf16": {"small": dict(ppp=2)}, "fp8": {}})
    ev_mine = msa_decode.score_candidates("bf16", "evict", sms=10, table=mine)       # an explicit table's entries
    assert ev_mine[0] == dict(gpu_config.SCORE_LAUNCH_BASE, ppp=2, evict="evict_first") and len(ev_mine) == 5
    both = msa_decode.family_candidates("bf16", ["narrow", "persistent", "narrow"], sms=10)
    assert len(both) == len(narrow) + 27                                   # duplicates dropped
    with pytest.raises(ValueError, match="unknown score family"):
        msa_decode.score_candidates("bf16", "fast")


def _sweep_row(b, ctx, keys, cls, config, ms):
    return dict(batch=b, context=ctx, keys=keys, size_class=cls, config=config, launch={}, ms=ms)


def test_pick_score_configs_per_case_and_class():
    """Each case keeps its own winner; a class takes the best geometric mean over its cases; a default
    that wins installs nothing; failed configs are ignored."""
    a, c, d = dict(programs=264), dict(ppp=4), dict(ppp=8)
    rows = [_sweep_row(32, 8, "fp8", "large", "default", 1.10), _sweep_row(32, 8, "fp8", "large", a, 1.00),
            _sweep_row(32, 8, "fp8", "large", c, 1.05),
            _sweep_row(1, 8, "fp8", "small", "default", 0.07), _sweep_row(1, 8, "fp8", "small", a, 0.09),
            _sweep_row(1, 8, "fp8", "small", c, 0.06),
            _sweep_row(2, 8, "fp8", "small", "default", 0.10), _sweep_row(2, 8, "fp8", "small", a, 0.05),
            _sweep_row(2, 8, "fp8", "small", c, 0.09),                      # small: a 0.64, c 0.77 (geomean)
            _sweep_row(1, 8, "bf16", "small", "default", 0.10), _sweep_row(1, 8, "bf16", "small", d, 0.11),
            dict(_sweep_row(1, 8, "bf16", "small", a, 0.0), error="boom")]
    del rows[-1]["ms"]
    per_case, per_class = msa_decode.pick_score_configs(rows)
    assert per_case["fp8"]["32x8"]["config"] == a and per_case["fp8"]["1x8"]["config"] == c
    assert per_case["fp8"]["1x8"]["speedup"] == pytest.approx(0.07 / 0.06)
    assert per_case["bf16"]["1x8"]["config"] == "default"
    assert per_class["fp8"]["large"]["config"] == a and per_class["fp8"]["large"]["gain"] == pytest.approx(1.1)
    assert per_class["fp8"]["small"]["config"] == a and per_class["fp8"]["small"]["cases"] == ["1x8", "2x8"]
    assert "bf16" not in per_class


def test_sweep_scores_installs_per_size_class(monkeypatch):
    """sweep_scores (interpret mode) times the table's launch and the candidates at two cases of different
    size classes; install_score_configs returns a copy of the launch table with each class's winner over the
    base (the default table unchanged); a spent sweep budget leaves the candidates untimed, never the default."""
    import jax.numpy as jnp

    from pallas_kernels.decode import gpu_config
    monkeypatch.setattr(gpu_config, "SCORE_CLASSES", (("small", 16), ("large", None)))
    cands = {"bf16": [dict(num_warps=1, num_stages=2, programs=3)], "fp8": [dict(ppp=2, f16=True)]}
    rows = msa_decode.sweep_scores([(1, 1024), (3, 1024)], 1, cands, l2_bytes=1, interpret=True)
    assert len(rows) == 2 * 2 * 2 and all("ms" in r and r["wall_s"] > 0 for r in rows)
    assert {(r["batch"], r["size_class"]) for r in rows} == {(1, "small"), (3, "large")}
    default = [r for r in rows if r["config"] == "default" and r["keys"] == "fp8" and r["batch"] == 3][0]
    assert default["launch"] == gpu_config.score_launch(jnp.float8_e4m3fn, total_pages=3 * 8)
    per_case, _ = msa_decode.pick_score_configs(rows)
    assert set(per_case["bf16"]) == {"1x1024", "3x1024"}
    pick = {"bf16": {"small": {"config": cands["bf16"][0]}}, "fp8": {"large": {"config": cands["fp8"][0]}}}
    before = gpu_config.DEFAULT_TABLE.to_dict()["score"]
    table = msa_decode.install_score_configs(pick).score
    assert table["bf16"]["small"] == dict(gpu_config.SCORE_LAUNCH_BASE, **cands["bf16"][0])
    assert table["fp8"]["large"] == dict(gpu_config.SCORE_LAUNCH_BASE, ppp=2, f16=True)
    assert table["bf16"]["large"] == before["bf16"]["large"] and table["fp8"]["small"] == before["fp8"]["small"]
    tuned = msa_decode.install_score_configs(pick, gpu_config.DEFAULT_TABLE)
    assert gpu_config.score_launch(jnp.bfloat16, total_pages=8, table=tuned)["programs"] == 3
    assert gpu_config.DEFAULT_TABLE.to_dict()["score"] == before                    # nothing written into it
    assert gpu_config.score_launch(jnp.bfloat16, total_pages=8)["programs"] == 0
    spent = msa_decode.sweep_scores([(1, 1024)], 1, cands, l2_bytes=1, interpret=True, budget_s=0.0)
    assert [("ms" in r, "skipped" in r) for r in spent] == [(True, False), (False, True)] * 2   # defaults only


def _refused(monkeypatch, capsys, argv):
    """``(exit code, stderr)`` of ``msa_decode.py`` given ``argv`` when its argument checks refuse them (``main`` in
    this process: the checks run before JAX does anything, so no subprocess needs to import it again); the module
    globals ``main`` sets are put back afterwards."""
    monkeypatch.setattr(msa_decode, "STEP_UNROLL", msa_decode.STEP_UNROLL)
    monkeypatch.setattr(sys, "argv", [os.path.join(ROOT, "bench", "msa_decode.py"), *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        msa_decode.main()
    return e.value.code, capsys.readouterr().err


def test_score_sweep_cli_smoke(tmp_path, monkeypatch, capsys):
    """--sweep-scores on the CPU (--smoke: kernels in interpret mode): sweep, per-case winners, the
    per-class install, the re-check of every class's launch, the table; a bad family is refused."""
    import json
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "msa_decode.py"), "--smoke", "--contexts", "2048",
           "--batches", "1", "--steps", "1", "--sweep-steps", "1", "--sweep-scores", "1x2048", "--score-family",
           "evict", "--sms", "2", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "score sweep bf16 1x2048: best" in r.stdout and "score sweep installed per size class" in r.stdout
    out = json.load(open(tmp_path / "msa_decode.json"))
    sw = out["score_sweep"]
    assert sw["families"] == ["evict"] and sw["sms"] == 2 and set(sw["best_per_case"]) == {"bf16", "fp8"}
    assert len(sw["rows"]) == 2 * (1 + len(msa_decode.score_candidates("bf16", "evict", sms=2)))
    assert out["check_tuned"]["ok"] and "select_fp8_large_set_mismatch_rows" in out["check_tuned"]
    assert len(out["rows"]) == 1
    code, err = _refused(monkeypatch, capsys, cmd[2:-2] + ["--score-family", "narrow,fast", "--out", str(tmp_path)])
    assert code == 2 and "unknown --score-family" in err


def test_geomean_best_needs_every_case_and_a_match():
    rows = [dict(batch=1, context=8, s=1, ms=2.0), dict(batch=32, context=8, s=1, ms=4.0),
            dict(batch=1, context=8, s=2, ms=1.0), dict(batch=32, context=8, s=2, ms=4.0),   # geomean 0.71
            dict(batch=1, context=8, s=4, ms=0.5, match=False), dict(batch=32, context=8, s=4, ms=1.0),
            dict(batch=1, context=8, s=8, ms=0.1)]                                          # one case only
    ratios, best = msa_decode._geomean_best(rows, "s", 1)
    assert best == 2 and set(ratios) == {"1", "2"}
    assert ratios["2"] == pytest.approx(2 ** -0.5)


def test_case_sizes_rotate_past_the_l2():
    npg, reps, steps, p = msa_decode.case_sizes(2, 4096, 3, l2_bytes=10 * 2 * 4096 * msa_decode.DI * 2)
    assert (npg, reps, steps, p) == (32, 10, 10, 10 * 2 * 32 + 1)
    assert msa_decode.case_sizes(32, 1 << 20, 4, l2_bytes=200 << 20)[1:3] == (1, 4)


def test_serving_cells_ragged_and_shuffled():
    """Lengths +-25 % around the context, seeded; every request's pages a disjoint shuffled set of 1..P-1 over
    the replicas, 0 past its own pages; rows at the last Q positions; the first cells before the grid, once."""
    sv = msa_decode_serving
    lens = sv.request_lengths(64, 4096, seed=3)
    assert lens.min() >= 3072 and lens.max() <= 5120 and len(set(lens.tolist())) > 32
    assert (lens == sv.request_lengths(64, 4096, seed=3)).all() and (lens != sv.request_lengths(64, 4096, 4)).any()
    lay = sv.layout(5, 1000, 3, seed=1, l2_bytes=4 * 5 * 1000 * msa_decode.DI * 2)
    assert (lay["replicas"], lay["steps_per_call"]) == (4, 4)
    assert (lay["pages"] == -(-lay["lengths"] // msa_decode.PAGE)).all() and lay["width"] == lay["pages"].max()
    assert lay["phys_pages"] == 4 * lay["pages"].sum() + 1
    t = sv.page_tables(lay, seed=1)
    assert t.shape == (4, 5, lay["width"]) and t.dtype == np.int32
    used = np.arange(lay["width"])[None, None, :] < lay["pages"][None, :, None]
    assert sorted(t[np.broadcast_to(used, t.shape)].tolist()) == list(range(1, lay["phys_pages"]))
    assert (t[~np.broadcast_to(used, t.shape)] == 0).all()
    assert not (np.diff(t[0, 0, :lay["pages"][0]]) == 1).all()                       # shuffled
    pos = sv.positions(np.array([20, 300]), 8)
    assert pos.tolist() == [list(range(12, 20)), list(range(292, 300))]
    assert sv.layout(3, 1600, 1, 0, 1, min_width=20)["width"] == 20
    assert sv.cell_order([1, 8], [1024, 4096], [(8, 4096), (2, 9)]) == [(8, 4096), (2, 9), (1, 1024), (8, 1024),
                                                                          (1, 4096)]


def test_serving_tilings_are_launch_tables():
    """Every ``--serving-tilings`` name builds a valid ``LaunchTable`` over the run's table (the names the
    device calls A/B: the XLA page union)."""
    from pallas_kernels.decode.gpu_config import DEFAULT_TABLE
    tables = msa_decode_serving.tiling_tables(list(msa_decode_serving.TILINGS), None)
    assert tables["default"] == DEFAULT_TABLE and tables["xla_union"].union == "xla"
    with pytest.raises(ValueError, match="unknown tilings"):
        msa_decode_serving.tiling_tables(["fit"], None)


def test_serving_sweep_skips_past_budget_and_memory():
    """Nothing is allocated for a cell over --mem-gib or once the budget is spent; both are listed."""
    cells, skipped, wall = msa_decode_serving.run_sweep([(128, 204800), (1, 1024)], [8, 1], 1, "xla", None,
                                                        mem_gib=1.0, budget_s=0.0)
    assert cells == [] and wall < 5
    assert [(s["batch"], s["q_rows"]) for s in skipped] == [(128, None), (1, None)]
    assert "GiB > --mem-gib 1.0" in skipped[0]["reason"] and "budget" in skipped[1]["reason"]


def test_serving_cli_smoke(tmp_path, monkeypatch, capsys):
    """--serving on the CPU (timed calls as a loop of 2 steps, one per iteration): the check (GPU kernels in interpret
    mode, the first tiling) first, then every (batch, context, Q, tiling, index dtype) cell with finite times and the path the op took, a cell over --mem-gib
    listed, the table last (with the tiling comparison). Q = 1 only: the check runs Q = 8, and the timed cells run
    the same code at any Q (the op has no Q-dependent path; Q = 8 cells cost ~1.5x the time)."""
    import json
    import math
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "msa_decode.py"), "--smoke", "--contexts", "", "--steps", "2",
           "--step-unroll", "1", "--serving", "--serving-batches", "2", "--serving-contexts", "512,2560", "--serving-q", "1",
           "--serving-first", "64x204800", "--mem-gib", "1", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.load(open(tmp_path / "msa_decode.json"))
    chk = out["serving_check"]
    assert chk["ok"] and chk["implementation"] == "pallas_gpu_interpret" and chk["all_pages_jit_path"] == "sparse"
    assert chk["bf16_set_mismatch_rows"] == 0 and chk["fp8_o_maxerr"] < 3e-2
    assert chk["tilings_ok"] == {"default": True}              # interpret mode: the first tiling's check only
    assert out["serving_config"]["tilings"]["legacy"]["sparse_tile"] == "per_row"
    cells = out["serving"]
    assert sorted((c["context"], c["q_rows"], c["tiling"], c["index_dtype"]) for c in cells) == sorted(
        (ctx, q, t, d) for ctx in (512, 2560) for q in (1,) for t in ("default", "legacy") for d in ("bf16", "fp8"))
    for c in cells:
        assert c["batch"] == 2 and all(math.isfinite(c[k]) and c[k] > 0 for k in ("dense_ms", "msa_ms", "speedup"))
        assert c["speedup"] == pytest.approx(c["dense_ms"] / c["msa_ms"])
        assert c["msa_path"] == ("dense" if c["context"] == 512 else "sparse")      # table <= K pages wide: dense
        assert 0.75 * c["context"] <= c["len_min"] <= c["len_max"] <= 1.25 * c["context"]
    assert [(s["batch"], s["context"]) for s in out["serving_skipped"]] == [(64, 204800)]
    assert out["serving_config"]["order"][0] == [64, 204800] and out["rows"] == []
    tail = r.stdout.rstrip().split("\n")[-8:]      # title, header, 4 lines, the tiling comparison, the skipped cell
    assert tail[0].startswith("serving sweep (check ok=True") and tail[-1].startswith("serving skipped: 64x204800")
    assert [ln.split()[6] for ln in tail[2:6]] == ["1.00"] * 4          # dense ms / Q=1: the cell's own Q = 1
    assert tail[-2].startswith("tiling legacy vs default: dense ") and "(4 cells;" in tail[-2]
    code, err = _refused(monkeypatch, capsys, cmd[2:-2] + ["--serving-q", "8,17", "--out", str(tmp_path)])
    assert code == 2 and "--serving-q takes 1..16" in err
    code, err = _refused(monkeypatch, capsys, cmd[2:-2] + ["--serving-tilings", "default,wide", "--out", str(tmp_path)])
    assert code == 2 and "unknown --serving-tilings ['wide']" in err


def test_decode_ncu_script_runs_every_kernel(monkeypatch, capsys):
    """bench/decode_ncu.py's ``main`` in this process (the kernels in interpret mode; no interpreter start-up)."""
    import decode_ncu

    monkeypatch.setattr(sys, "argv", ["decode_ncu.py", "--batch", "1", "--context", "512", "--interpret"])
    capsys.readouterr()
    decode_ncu.main()
    out = capsys.readouterr().out
    for name in ("scores_bf16", "scores_fp8", "sparse_attention", "dense_attention"):
        assert f"{name}: shape" in out and f"{name}: shape" in out.split("ok")[0]
    assert out.rstrip().endswith("ok")
    monkeypatch.setattr(sys, "argv", ["decode_ncu.py", "--context", "100"])
    with pytest.raises(SystemExit) as e:
        decode_ncu.main()
    assert e.value.code == 2 and "multiple of 128" in capsys.readouterr().err
