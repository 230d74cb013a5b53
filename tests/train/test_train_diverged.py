"""A loss that becomes NaN stops the run with TrainingDiverged (exit 1 from train.py) and no checkpoint of the
diverged state: the checkpoints kept are the last finite ones."""

import math

import pytest

from minimax_jax.train import loop
from minimax_jax.train.config import from_dict
from tests.train_helpers import micro_train_dict


@pytest.mark.parametrize("log_every", [1, 5])
def test_a_nan_loss_stops_without_saving_it(tmp_path, monkeypatch, log_every):
    """The loss turns NaN from step 4 on; checkpoints every 2 steps. Logged every step: stop at step 4 (the last
    checkpoint is step 2). Logged every 5 steps: the check at the step-4 checkpoint stops it first."""
    real = loop.Trainer.run_step

    def run_step(self, phase, state, batch):
        state, m = real(self, phase, state, batch)
        run_step.calls += 1
        return state, ({**m, "loss": m["loss"] * math.nan} if run_step.calls >= 4 else m)
    run_step.calls = 0
    monkeypatch.setattr(loop.Trainer, "run_step", run_step)
    tc = from_dict(micro_train_dict(str(tmp_path / "run"), run={"steps": 6, "log_every": log_every}))
    with pytest.raises(loop.TrainingDiverged, match=r"the loss is nan at step 4: stopping without saving this "
                                                    r"state \(the last checkpoint is step 2\)"):
        loop.train(tc)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]


def test_a_nan_gradient_norm_with_a_finite_loss_stops_too(tmp_path, monkeypatch):
    """A finite loss whose update was not (grad_norm inf at step 2, the checkpoint step) is not saved either."""
    real = loop.Trainer.run_step

    def run_step(self, phase, state, batch):
        state, m = real(self, phase, state, batch)
        run_step.calls += 1
        return state, ({**m, "grad_norm": m["grad_norm"] * math.inf} if run_step.calls == 2 else m)
    run_step.calls = 0
    monkeypatch.setattr(loop.Trainer, "run_step", run_step)
    tc = from_dict(micro_train_dict(str(tmp_path / "run"), run={"steps": 6, "log_every": 5}))
    with pytest.raises(loop.TrainingDiverged, match=r"the grad_norm is inf at step 2: .*no checkpoint was saved"):
        loop.train(tc)
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()]
