"""Resuming with another ``run.steps``: the run continues on the new schedule only when the learning rates of
the steps already trained stay the same (WSD in its stable phase, constant, a cosine with ``decay_steps``);
a cosine stretched mid-run is refused with one line saying how to extend it, before anything is written."""

import dataclasses
import os

import pytest

from minimax_jax.train import train
from minimax_jax.train.config import TrainConfigError, from_dict
from minimax_jax.train.optimizer import make_schedule, resume_schedule_check
from tests.train_helpers import micro_train_dict


def _tc(kind, steps=100, **schedule):
    return from_dict(micro_train_dict("unused", schedule={"kind": kind, "warmup_steps": 10, **schedule},
                                      run={"steps": steps}))


def test_check_compares_the_learning_rates_of_the_trained_steps():
    assert resume_schedule_check(_tc("cosine"), 100, 50) is None               # run.steps unchanged
    ok, line = resume_schedule_check(_tc("cosine", 200), 100, 50)
    assert not ok and "run.steps 100 -> 200 would change the learning rate of steps already trained" in line
    assert "--set schedule.decay_steps=90" in line and "init.mode: checkpoint" in line
    # that advice keeps the trained curve: accepted, and the extra steps run at the final learning rate
    fixed = _tc("cosine", 200, decay_steps=90)
    assert resume_schedule_check(fixed, 100, 50)[0]
    old = make_schedule(dataclasses.replace(fixed, run=dataclasses.replace(fixed.run, steps=100)))
    assert float(make_schedule(fixed)(150)) == pytest.approx(float(old(100)))
    assert resume_schedule_check(_tc("wsd", 200), 100, 50)[0]                   # stable phase: extended
    ok, line = resume_schedule_check(_tc("wsd", 200), 100, 90)                   # mid-decay: refused
    assert not ok and "stable phase" in line
    assert resume_schedule_check(_tc("constant", 200), 100, 50) == (
        True, "run.steps 100 -> 200: the learning rates of the 50 steps trained so far are unchanged (constant "
              "schedule); continuing on the schedule of 200 steps")
    assert resume_schedule_check(_tc("cosine", 200), 100, 5)[0]                  # still warming up: same rates


def test_check_uses_the_checkpoints_schedule_and_a_clipped_warm_up():
    """The trained curve comes from the checkpoint's own config (not today's settings); when its warm-up was
    clipped to a short run.steps, the advice keeps that warm-up too, and following it is accepted."""
    short = _tc("cosine", 4)                                                     # warm-up 10 clipped to 4
    ok, line = resume_schedule_check(_tc("cosine", 6), 4, 4, saved=short)
    assert not ok and "--set schedule.decay_steps=1 schedule.warmup_steps=4" in line, line
    assert resume_schedule_check(_tc("cosine", 6, decay_steps=1, warmup_steps=4), 4, 4, saved=short)[0]
    # a run extended once (decay_steps=40 after 50 steps), then again without it: the advice is the saved 40
    ext = _tc("cosine", 60, decay_steps=40)
    ok, line = resume_schedule_check(_tc("cosine", 100), 60, 60, saved=ext)
    assert not ok and "--set schedule.decay_steps=40" in line and "warmup_steps" not in line, line
    assert resume_schedule_check(_tc("cosine", 100, decay_steps=40), 60, 60, saved=ext)[0]


def test_train_refuses_a_stretched_cosine_and_writes_nothing(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    base = micro_train_dict(run_dir, data={"kind": "synthetic", "seq_len": 16, "batch_size": 2},
                            schedule={"kind": "cosine", "warmup_steps": 1}, run={"steps": 6, "stop_after": 3},
                            checkpoint={"every": 1, "async_save": False})
    assert train(from_dict(base))["step"] == 3
    files = {f: open(os.path.join(run_dir, f), "rb").read() for f in ("config.yaml", "metrics.jsonl")}
    longer = {**base, "run": {**base["run"], "steps": 12, "stop_after": 1}}
    with pytest.raises(TrainConfigError, match=r"run.steps 6 -> 12 would change .* step 3 was trained at .*"
                                               r"schedule.decay_steps=5"):
        train(from_dict(longer))
    assert {f: open(os.path.join(run_dir, f), "rb").read() for f in files} == files
    # train.py --check_only says the same (exit 2), reading only the checkpoint's metadata
    from minimax_jax.train.loop import resume_refusal

    refusal = resume_refusal(from_dict(longer))
    assert refusal is not None and "run.steps 6 -> 12 would change" in refusal
    assert resume_refusal(from_dict(base)) is None
    assert {f: open(os.path.join(run_dir, f), "rb").read() for f in files} == files
    capsys.readouterr()
    kept = {**longer, "schedule": {**base["schedule"], "decay_steps": 5}}         # the advice: accepted
    assert train(from_dict(kept))["step"] == 4
    assert "run.steps 6 -> 12: the learning rates of the 3 steps trained so far are unchanged" in capsys.readouterr().out


def test_a_checkpoint_config_that_no_longer_parses_is_said():
    """When the checkpoint's train_config does not parse, the check uses today's schedule and its line says so."""
    from minimax_jax.train.loop import _schedule_check

    meta = {"train_config": {"run": {"steps": 100}, "no_such_section": {}}}
    ok, line = _schedule_check(_tc("cosine", 200), 50, meta)
    assert not ok and line.endswith("(the checkpoint's training config no longer parses: its curve was rebuilt "
                                    "from today's schedule settings)"), line
