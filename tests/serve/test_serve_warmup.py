"""Server warm-up (``build(warmup=True)``, ``serve --warmup``; the shipped demo model): the engine's steps compile
before the server returns, so that requests afterwards (greedy ones decoded in device loops, a sampled one and a
penalised one decoded one step at a time beside them, a prompt of several prefill chunks reaching wider page
tables), with plain and with MTP speculative decoding, compile none of them; the warm-up requests are not counted
by the metrics; a failed warm-up names its request and stops the worker."""

from __future__ import annotations

import concurrent.futures
import threading

import jax
import pytest

from minimax_jax.serve.scheduler import Scheduler
from minimax_jax.serve.server import build
from tests.serve.serving import running

MODEL = "demo"
STEPS = ("jit(model_step)", "jit(greedy_steps)")      # the engine's compiled prefill / decode step and its device loop


@pytest.fixture
def compiles():
    """Names of the jitted functions compiled while the test runs (jax.monitoring's backend-compile event)."""
    names = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kw.get("fun_name"))
    jax.monitoring.register_event_duration_secs_listener(listen)
    yield names
    jax.monitoring.unregister_event_duration_listener(listen)


LONG = "FIRST CITIZEN:\nBefore we proceed any further, hear me speak. " * 6      # several 16-token chunks


@pytest.mark.parametrize("kw", [dict(decode_loop=4), dict(decode_loop=4, speculative="mtp", mtp_window=8)],
                         ids=["loop", "mtp+loop"])
def test_requests_after_warm_up_compile_no_step(demo, compiles, kw):
    with running(demo, max_batch=3, max_len=256, prefill_chunk=16, warmup=True, **kw) as srv:
        assert [n for n in compiles if n in STEPS], "the warm-up compiled nothing: the test would prove nothing"
        assert srv.server.metrics.finished_by == {} and srv.server.metrics.prompt_tokens == 0   # not counted
        compiles.clear()
        c = srv.client

        def ask(kw):
            return c.completions.create(model=MODEL, max_tokens=9, **kw).choices[0].text
        reqs = [dict(prompt="ROMEO:", temperature=0), dict(prompt="JULIET:\nO Romeo", temperature=0),
                dict(prompt="K", temperature=1.0, seed=3),
                dict(prompt="MACBETH:", temperature=0, extra_body={"repetition_penalty": 1.2})]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert all(isinstance(t, str) for t in pool.map(ask, reqs))
        assert ask(dict(prompt=LONG, temperature=0))                                   # wider page tables
        assert srv.wait_idle()
        assert [n for n in compiles if n in STEPS] == []
        assert sum(srv.server.metrics.finished_by.values()) == 5


def test_failed_warm_up_says_which_request_and_stops_the_worker(demo, monkeypatch):
    def workers():
        return sum(t.name == "minimax-serve-worker" and t.is_alive() for t in threading.enumerate())
    before = workers()

    def failing_submit(self, seqs):
        for seq in seqs:
            seq.emit({"type": "error", "message": "prefill failed: boom"})
    monkeypatch.setattr(Scheduler, "submit", failing_submit)
    with pytest.raises(RuntimeError, match="greedy warm-up request failed: prefill failed"):
        build(demo, max_batch=1, max_len=64, prefill_chunk=16, warmup=True)
    assert workers() == before
