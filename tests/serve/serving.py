"""A real server for the tests: the shipped demo model, ``minimax_jax.serve.server.build``, uvicorn on a
free loopback port in a background thread (``server.in_thread``), and an ``openai`` client pointed at it."""

from __future__ import annotations

import contextlib
import time

import openai

from minimax_jax.serve.server import build, free_port, in_thread

__all__ = ["PREFILL_CHUNK", "Running", "free_port", "running"]

#: The prefill chunk of the tests' servers and reference loops. A prefill call computes a whole chunk, so the
#: default 256 makes every short prompt cost a 256-token forward; prompts over 64 tokens still take several
#: chunks. The default chunk is served by tests/serve/test_serve_cli.py.
PREFILL_CHUNK = 64


class Running:
    def __init__(self, server, port: int):
        self.server, self.port = server, port
        self.base = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", max_retries=0, timeout=120)

    @property
    def scheduler(self):
        return self.server.scheduler

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """True once no sequence is active or waiting and every engine slot is free."""
        end = time.monotonic() + timeout
        s = self.scheduler
        while time.monotonic() < end:
            if s.active_count == 0 and s.queue_length == 0 and s.free_slots() == s.max_batch:
                return True
            time.sleep(0.05)
        return False


@contextlib.contextmanager
def running(model, **build_kw):
    srv = build(model, **build_kw)
    try:
        with in_thread(srv.app) as port:
            yield Running(srv, port)
    finally:
        srv.close()
