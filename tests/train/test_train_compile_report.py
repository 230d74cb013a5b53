"""Honest throughput: training says when it compiles and how long it took, reports that time as
``compile_s``, and keeps every step that compiled (the first of each phase: here an MSA indexer
warm-up, then the sparse phase) out of ``tokens_per_s``."""

import json
import os
import re

from minimax_jax.train import train
from minimax_jax.train.config import from_dict
from tests.train_helpers import MICRO_MSA_MODEL, micro_train_dict


def test_compile_time_reported_apart_from_tokens_per_s(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    tc = from_dict(micro_train_dict(run_dir, model=MICRO_MSA_MODEL, data={"kind": "synthetic", "seq_len": 32,
                                                                          "batch_size": 2, "seed": 0},
                                    msa={"indexer_warmup_steps": 2}, run={"steps": 5},
                                    checkpoint={"every": 0, "async_save": False}))
    assert train(tc)["status"] == "completed"
    out = capsys.readouterr().out
    assert re.findall(r"step (\d+): compiling the train step \((\w+) phase\)\.\.\.", out) == [
        ("1", "indexer_warmup"), ("3", "main")], out
    compiled = [float(x) for x in re.findall(r"compiled in ([0-9.]+) s \(first step done in [0-9.]+ s\)", out)]
    assert len(compiled) == 2, out
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = {r["step"]: r for r in map(json.loads, f)}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for s in (1, 3):                                 # the compiling steps: timed apart, no throughput
        assert "tokens_per_s" not in rows[s] and rows[s]["compile_s"] > 0, rows[s]
    tokens_per_step = 2 * 32
    for s in (2, 4, 5):
        assert "compile_s" not in rows[s]
        # a step measured with its compile in would run at most tokens_per_step / compile_s
        assert rows[s]["tokens_per_s"] > tokens_per_step / min(rows[1]["compile_s"], rows[3]["compile_s"])
    assert [round(rows[s]["compile_s"], 1) for s in (1, 3)] == compiled
