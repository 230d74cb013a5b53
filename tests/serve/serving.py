"""A real server for the tests: the shipped demo model, ``minimax_jax.serve.server.build``, uvicorn on a
free loopback port in a background thread, and an ``openai`` client pointed at it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import openai
import uvicorn

from minimax_jax.serve.server import build


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(srv.app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=uv.run, daemon=True)
    th.start()
    end = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > end or not th.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield Running(srv, port)
    finally:
        uv.should_exit = True
        th.join(10)
        srv.close()
