"""Assemble the server from a loaded model: ``Generator`` -> ``Scheduler`` (worker thread) ->
FastAPI app; ``serve_forever`` runs it under uvicorn. Tests use ``build`` and their own uvicorn
thread."""

from __future__ import annotations

import dataclasses
import os

from minimax_jax.infer.generation import Generator
from minimax_jax.serve.app import build_app
from minimax_jax.serve.metrics import Metrics
from minimax_jax.serve.scheduler import Scheduler

__all__ = ["Server", "build"]


@dataclasses.dataclass
class Server:
    app: object
    scheduler: Scheduler
    metrics: Metrics
    model_name: str

    def close(self) -> None:
        self.scheduler.stop()


def build(model, *, max_batch: int = 8, max_len: int = 4096, max_queue: int = 64, prefill_chunk: int = 256,
          model_name: str | None = None, default_max_tokens: int = 256, prefix_cache: bool = True) -> Server:
    """A started server over ``model`` (``minimax_jax.infer.LoadedModel``): ``max_batch`` engine slots of
    ``max_len`` tokens (prompt + completion), at most ``max_queue`` waiting sequences. The page pool is
    the engine's default (every slot at ``max_len``); ``model_name`` defaults to the checkpoint folder's
    name."""
    gen = Generator(model.cfg, model.params, model.tokenizer, engine="paged",
                    engine_options={"prefill_chunk": prefill_chunk, "prefix_cache": prefix_cache})
    metrics = Metrics()
    sched = Scheduler(gen, max_batch=max_batch, max_len=max_len, max_queue=max_queue, metrics=metrics)
    name = model_name or os.path.basename(os.path.normpath(model.checkpoint_dir))
    app = build_app(sched, model.tokenizer, name, metrics=metrics, default_max_tokens=default_max_tokens)
    sched.start()
    return Server(app, sched, metrics, name)
