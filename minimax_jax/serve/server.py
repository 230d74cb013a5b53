"""Assemble the server from a loaded model: ``Generator`` -> ``Scheduler`` (worker thread) ->
FastAPI app. ``in_thread`` runs an app under uvicorn in a background thread on a free loopback port
(the tests and ``bench/serve_load.py``); the CLI runs uvicorn in the foreground."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time

from minimax_jax.infer.generation import Generator
from minimax_jax.serve.app import build_app
from minimax_jax.serve.metrics import Metrics
from minimax_jax.serve.scheduler import Scheduler

__all__ = ["Server", "build", "free_port", "in_thread"]


@dataclasses.dataclass
class Server:
    app: object
    scheduler: Scheduler
    metrics: Metrics
    model_name: str

    def close(self) -> None:
        self.scheduler.stop()


def build(model, *, max_batch: int = 8, max_len: int = 4096, max_queue: int = 64, prefill_chunk: int = 256,
          model_name: str | None = None, default_max_tokens: int = 256, prefix_cache: bool = True,
          token_budget: int | None = None, speculative: str | None = None, num_draft: int | None = None,
          mtp_window: int = 64, decode_loop: int = 1, warmup: bool = False) -> Server:
    """A started server over ``model`` (``minimax_jax.infer.LoadedModel``): ``max_batch`` engine slots of
    ``max_len`` tokens (prompt + completion), at most ``max_queue`` waiting sequences, ``token_budget``
    tokens per scheduler iteration (``Scheduler``; None = a prefill chunk per prefilling sequence on top of
    the decode tokens), ``speculative`` None or "mtp", ``decode_loop`` greedy steps per device loop
    (``Scheduler``); a model loaded on a mesh runs the
    engine on it (``Scheduler(mesh=...)``). The page pool is the engine's
    default (every slot at ``max_len``); ``model_name`` defaults to the checkpoint folder's name. ``warmup``:
    compile the engine's steps before returning (``Scheduler.warm_up``; RuntimeError if a warm-up request
    fails, the worker then stopped)."""
    gen = Generator(model.cfg, model.params, model.tokenizer, engine="paged",
                    engine_options={"prefill_chunk": prefill_chunk, "prefix_cache": prefix_cache})
    metrics = Metrics()
    mesh = None if getattr(model, "mesh", None) is None else (model.mesh, model.rules)
    sched = Scheduler(gen, max_batch=max_batch, max_len=max_len, max_queue=max_queue,
                      token_budget=token_budget, metrics=metrics, speculative=speculative, num_draft=num_draft,
                      mtp_window=mtp_window, mesh=mesh, decode_loop=decode_loop)
    name = model_name or os.path.basename(os.path.normpath(model.checkpoint_dir))
    app = build_app(sched, model.tokenizer, name, metrics=metrics, default_max_tokens=default_max_tokens)
    sched.start()
    if warmup:
        try:
            sched.warm_up(model.cfg.vocab_size)
        except BaseException:
            sched.stop()
            raise
    return Server(app, sched, metrics, name)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Idle keep-alive connections are closed by the server after this many seconds. Longer than the
# clients' own pool expiry (httpx, under the openai client: 5 s), so the client drops an idle
# connection first; at uvicorn's default (5 s, the same as httpx) a request sent on a connection the
# server is closing at that moment fails as a connection error (seen under load while a long
# prefill kept the event loop waiting).
KEEP_ALIVE_S = 65


def uvicorn_config(app, *, host: str, port: int, keep_alive_s: float = KEEP_ALIVE_S):
    """The uvicorn config both the CLI and ``in_thread`` run ``app`` with."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_keep_alive=keep_alive_s)


@contextlib.contextmanager
def in_thread(app, *, host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 30.0):
    """Run ``app`` under uvicorn in a daemon thread; yields the port once it listens. Raises
    RuntimeError when uvicorn does not start within ``start_timeout_s``."""
    import uvicorn

    port = free_port(host) if port is None else port
    uv = uvicorn.Server(uvicorn_config(app, host=host, port=port))
    th = threading.Thread(target=uv.run, daemon=True)
    th.start()
    end = time.monotonic() + start_timeout_s
    while not uv.started:
        if time.monotonic() > end or not th.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield port
    finally:
        uv.should_exit = True
        th.join(10)
