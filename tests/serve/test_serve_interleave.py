"""Chunked prefill interleaved with decode (``Scheduler`` on the demo model, no HTTP): a running stream
keeps getting a token per scheduler iteration while a long prompt is prefilled a chunk at a time, and
``DecodeEngine.prefill_start`` / ``prefill_advance`` (the scheduler's path) give the logits of the
one-call ``prefill``, under a token budget too; with ``Scheduler.token_budget`` N, what the scheduler
issues per iteration (recorded by wrapping the engine's calls) never prefills more than N minus the
decoding rows, splits prompts across iterations and keeps a decode step in every iteration."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from minimax_jax.infer.generation import Generator
from minimax_jax.infer.loading import load_model
from minimax_jax.infer.sampler import SamplingParams
from minimax_jax.serve.scheduler import Scheduler, Sequence

CHUNK = 64


@pytest.fixture(scope="module")
def sched():
    m = load_model(None, log=lambda _m: None)
    gen = Generator(m.cfg, m.params, m.tokenizer, engine="paged",
                    engine_options={"prefill_chunk": CHUNK, "prefix_cache": False})
    s = Scheduler(gen, max_batch=4, max_len=1024)
    s.start()
    yield s
    s.stop()


def _long_prompt(n: int) -> list[int]:
    return np.random.default_rng(0).integers(3, 2000, n).tolist()


def test_a_running_stream_keeps_decoding_while_a_long_prompt_is_prefilled(sched):
    log, lock, finished = [], threading.Lock(), {"a": threading.Event(), "b": threading.Event()}

    def sink(who):
        def emit(ev):
            with lock:
                log.append((who, ev["type"]))
            if ev["type"] != "token":
                finished[who].set()
        return emit

    greedy = SamplingParams(temperature=0.0)
    a = Sequence(sched.gen.encode("ROMEO:"), 40, greedy, sink("a"), logprobs=0, ignore_eos=True)
    long = _long_prompt(8 * CHUNK)
    b = Sequence(long, 3, greedy, sink("b"), logprobs=0, ignore_eos=True)
    sched.submit([a])
    while sum(e == ("a", "token") for e in list(log)) < 2:
        assert not finished["a"].is_set()
        threading.Event().wait(0.01)
    with lock:
        log.append(("b", "submitted"))
    sched.submit([b])
    assert finished["b"].wait(120) and finished["a"].wait(120)
    assert ("a", "done") in log and ("b", "done") in log and ("a", "error") not in log
    start, first_b = log.index(("b", "submitted")), log.index(("b", "token"))
    a_during = sum(e == ("a", "token") for e in log[start:first_b])
    # 8 prefill chunks of b, one decode step of a after each (the one-shot prefill would give 0)
    assert a_during >= 6, log[start:first_b + 1]
    assert sum(e == ("a", "token") for e in log) == 40 and sum(e == ("b", "token") for e in log) == 3


def test_prefill_in_chunks_gives_the_one_call_logits(sched):
    eng = sched.engine
    assert sched.active_count == 0
    p, q = _long_prompt(5 * CHUNK + 7), _long_prompt(CHUNK - 9)[::-1]
    slots, want = eng.prefill([p, q])
    want = {slots[0]: np.asarray(want[0]), slots[1]: np.asarray(want[1])}
    for s in slots:
        eng.free(s)
    a, b = eng.prefill_start(p), eng.prefill_start(q)
    assert (eng.prefill_remaining(a), eng.prefill_remaining(b)) == (len(p), len(q))
    got = eng.prefill_advance([a, b], max_tokens=10)               # budget: 10 tokens, all to the first
    assert got == {} and (eng.prefill_remaining(a), eng.prefill_remaining(b)) == (len(p) - 10, len(q))
    while eng.prefill_remaining(a) or eng.prefill_remaining(b):
        got.update(eng.prefill_advance([s for s in (a, b) if eng.prefill_remaining(s)]))
    assert sorted(got) == sorted((a, b)) and eng.length(a) == len(p) and eng.length(b) == len(q)
    for mine, ref in ((a, slots[0]), (b, slots[1])):
        assert got[mine].shape == want[ref].shape == (1, sched.gen.cfg.vocab_size)
        np.testing.assert_allclose(got[mine], want[ref], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no pending prefill"):
        eng.prefill_advance([a])
    eng.free(a)
    eng.free(b)


def test_the_token_budget_bounds_what_each_iteration_prefills(sched):
    """Budget N = 40: two streams decode while prompts of 150 and 100 tokens are prefilled; every
    ``prefill_advance`` the worker issues computes at most N - (decoding rows) prompt tokens (<= one chunk
    per sequence), and a decode step of the streams follows each one."""
    n_budget, eng, log = 40, sched.engine, []
    real_advance, real_step = eng.prefill_advance, sched.backend.step

    def advance(slots, max_tokens=None):
        before = {s: eng.prefill_remaining(s) for s in slots}
        decoding = len(sched._active)
        out = real_advance(slots, max_tokens)
        log.append(("prefill", decoding, {s: before[s] - eng.prefill_remaining(s) for s in slots}))
        return out

    def step(handles, tokens, **kw):
        log.append(("decode", len(handles), np.asarray(tokens).shape[1]))
        return real_step(handles, tokens, **kw)

    events: dict = {}
    done = {k: threading.Event() for k in "abcd"}

    def sink(who):
        def emit(ev):
            events.setdefault(who, []).append(ev["type"])
            if ev["type"] != "token":
                done[who].set()
        return emit

    greedy = SamplingParams(temperature=0.0)
    streams = [Sequence(sched.gen.encode(p), 60, greedy, sink(k), ignore_eos=True)
               for k, p in (("a", "ROMEO:"), ("b", "JULIET:"))]
    longs = [Sequence(_long_prompt(150), 2, greedy, sink("c"), ignore_eos=True),
             Sequence(_long_prompt(100)[::-1], 2, greedy, sink("d"), ignore_eos=True)]
    assert sched.active_count == 0
    sched.token_budget, eng.prefill_advance, sched.backend.step = n_budget, advance, step
    try:
        sched.submit(streams)
        while not all(events.get(k, []).count("token") >= 1 for k in "ab"):
            threading.Event().wait(0.01)
        mark = len(log)
        sched.submit(longs)
        assert all(d.wait(120) for d in done.values())
    finally:
        sched.token_budget = None
        del eng.prefill_advance, sched.backend.step
    assert all(events[k][-1] == "done" and "error" not in events[k] for k in "abcd")
    run = log[mark:]
    prefills = [r for r in run if r[0] == "prefill"]
    assert sum(sum(r[2].values()) for r in prefills) == 250                 # both prompts, no prefix cache
    for r in prefills:
        assert r[1] >= 2                                                    # the streams were decoding
        assert 0 < sum(r[2].values()) <= n_budget - r[1], r
        assert all(n <= CHUNK for n in r[2].values())
    assert len(prefills) >= 250 // (n_budget - 2)                          # split across iterations
    assert any(sum(n > 0 for n in r[2].values()) == 2 for r in prefills)    # two prompts sharing one budget
    for i, r in enumerate(run):
        if r[0] == "prefill":                                              # each iteration decodes the streams too
            assert run[i + 1][0] == "decode" and run[i + 1][1] >= 2, run[i:i + 2]
