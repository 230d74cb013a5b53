"""Training: config (YAML + overrides), optax optimizer, losses, the step, orbax checkpoints, metrics,
and the loop. Entry points: ``load_train_config`` and ``train`` (CLI: ``train.py``)."""

from minimax_jax.train.config import TrainConfig, TrainConfigError, load_train_config
from minimax_jax.train.loop import Trainer, train

__all__ = ["TrainConfig", "TrainConfigError", "Trainer", "load_train_config", "train"]
