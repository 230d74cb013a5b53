"""bench/long_context_infer.py on CPU: a tiny MSA checkpoint at a tiny context writes its JSON rows with
the expected fields (MSA and dense), and the budget logic skips / kills cases with clear rows.
Also: every bench/*.sh (device_suite.sh, the one-call checks) is valid bash."""

from tests.paths import REPO_ROOT
import json
import os
import shutil
import subprocess
import sys

import jax
import pytest

from minimax_jax.data.tokenizer import special_token_ids
from minimax_jax.model import init_params
from tests import infer_helpers as H

ROOT = REPO_ROOT
SCRIPT = os.path.join(ROOT, "bench", "long_context_infer.py")
FIELDS = {"context", "prompt_tokens", "attention", "attention_note", "status", "implementation_report", "ttft_s",
          "prefill_s", "prefill_tok_s", "decode_s", "decode_tok_s", "new_tokens", "warmup_s", "load_s", "engine",
          "prefill_chunk", "prefill_implementation", "prefill_widths", "compiled_widths", "compile_prefill_s"}


@pytest.fixture(scope="module")
def tiny_msa_ckpt(tmp_path_factory):
    tok = H.tiny_tokenizer()
    special = special_token_ids(tok)
    cfg = H.tiny_config(tok.get_vocab_size(), num_layers=2, layer_types=("full", "msa"), mlp_types=("dense", "dense"),
                        index_head_dim=8, index_block_size=16, index_topk=2, bos_token_id=special["bos_token_id"],
                        eos_token_id=special["eos_token_id"], pad_token_id=special["pad_token_id"])
    return H.save_checkpoint(str(tmp_path_factory.mktemp("lc") / "ckpt"), cfg, init_params(cfg, jax.random.key(0)),
                             tok)


def _bench(out, *args, timeout=180):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, SCRIPT, f"--out={out}", *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(out, "long_context_infer.json")) as f:
        return json.load(f)["rows"], r


def test_long_context_rows_msa_and_dense(tiny_msa_ckpt, tmp_path):
    rows, r = _bench(str(tmp_path), f"--checkpoint={tiny_msa_ckpt}", "--contexts=256", "--max-new-tokens=8",
                     "--prefill-chunk=64", "--budget-s=150", "--max_position_embeddings=4096")
    assert [(x["context"], x["attention"], x["status"]) for x in rows] == [(256, "as_trained", "ok"),
                                                                           (256, "dense", "ok")]
    for x in rows:
        assert FIELDS <= set(x), FIELDS - set(x)
        assert x["prompt_tokens"] == 256 - 8 - 1 and x["new_tokens"] == 8
        assert x["ttft_s"] > 0 and x["decode_tok_s"] > 0 and x["prefill_tok_s"] > 0
        assert x["max_position_embeddings"] == 4096 and x["max_position_embeddings_overridden"]
        assert os.path.isfile(tmp_path / x["log"])
        assert x["prefill_chunk"] == 64 and x["prefill_implementation"] == "auto" and x["prefill_widths"] == "pow2"
        w = x["compiled_widths"]                                    # CPU: XLA ops, power-of-two page buckets
        assert len(w) > 1 and w == sorted(w) and all(v & (v - 1) == 0 for v in w)
    msa, dense = rows
    assert "msa_select_blocks" in msa["implementation_report"]
    assert not any(k.startswith("msa") for k in dense["implementation_report"])
    assert msa["prompt_sha256"] == dense["prompt_sha256"]          # the same deterministic prompt
    assert "as_trained" in r.stdout and "dense" in r.stdout         # the table


def test_budget_skips_and_kills_cleanly(tiny_msa_ckpt, tmp_path):
    rows, _ = _bench(str(tmp_path), f"--checkpoint={tiny_msa_ckpt}", "--contexts=256,512", "--attentions=dense",
                     "--budget-s=1.5", "--min-case-s=1", "--max_position_embeddings=4096")
    # a case needs several seconds (interpreter start, jax import, load, compile): 1.5 s always kills it
    assert rows[0]["status"] == "timeout" and rows[0]["wall_s"] < 15      # killed at the budget
    assert rows[1]["status"] == "skipped" and "left" in rows[1]["reason"]


def test_bad_arguments_are_clear_errors(tmp_path, monkeypatch, capsys):
    """The script's ``main(argv)`` in this process (argparse refuses before any work; no interpreter start-up)."""
    import importlib

    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    main = importlib.import_module("long_context_infer").main
    for bad, msg in (("--contexts=1000", "powers of two"), ("--attentions=sparse", "attention mode must be one of")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main([f"--out={tmp_path}", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err, err


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_device_scripts_are_valid_bash():
    scripts = sorted(f for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".sh"))
    assert "device_suite.sh" in scripts and "moe_ws_check.sh" in scripts
    for f in scripts:
        r = subprocess.run(["bash", "-n", os.path.join(ROOT, "bench", f)], capture_output=True, text=True)
        assert r.returncode == 0, (f, r.stderr)
