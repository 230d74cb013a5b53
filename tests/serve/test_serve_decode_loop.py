"""Multi-step scheduling in the server (``build(decode_loop=4)``, the shipped demo model) through the real
``openai`` client: greedy completions alone and concurrent (completion lengths that are not multiples of the
loop, a chunked prefill, a stop string) equal the plain greedy generation loop, and device loops really ran;
a request with logprobs or a sampled one rides along (one step at a time while it decodes) and finishes; with
``speculative="mtp"`` the loops are speculative ones, with the same output (slow)."""

from __future__ import annotations

import concurrent.futures

import pytest

from minimax_jax.infer.generation import GenerationConfig
from tests.serve.serving import running

MODEL = "demo"
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo, wherefore art thou", "def main(", "K",
           "FIRST CITIZEN:\nBefore we proceed any further, hear me speak. " * 6,         # > one 64-token chunk
           "MACBETH:\nIs this a dagger " * 3]


@pytest.fixture(scope="module")
def srv(demo):
    with running(demo, max_batch=4, max_len=512, prefill_chunk=64, decode_loop=4) as r:
        yield r


def _case(i: int) -> tuple[str, int]:
    return PROMPTS[i % len(PROMPTS)], 3 + 5 * (i % 4)          # 3, 8, 13, 18 tokens


def _plain(gen, prompt: str, n: int, stop=()) -> str:
    return gen.generate_text([prompt], GenerationConfig(max_new_tokens=n, stop_strings=tuple(stop))).sequences[0].text


def _ask(srv, i: int, **kw) -> str:
    prompt, n = _case(i)
    return srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                         **kw).choices[0].text


def test_loops_give_plain_greedy_output(srv, gen, monkeypatch):
    sched = srv.scheduler
    loops = []
    greedy = sched.backend.greedy
    monkeypatch.setattr(sched.backend, "greedy", lambda *a: loops.append(a[2]) or greedy(*a))
    want = [_plain(gen, *_case(i)) for i in range(7)]
    assert [_ask(srv, i) for i in range(len(PROMPTS))] == want[:len(PROMPTS)]
    assert loops and set(loops) == {4}                                     # device loops of 4 steps ran
    with concurrent.futures.ThreadPoolExecutor(7) as pool:                 # > 4 slots: batched, some wait
        got = list(pool.map(lambda i: _ask(srv, i), range(7)))
    assert got == want
    text = _plain(gen, PROMPTS[1], 18)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop and _ask(srv, 7, stop=[stop]) == _plain(gen, PROMPTS[1], 18, [stop])
    assert srv.wait_idle()


def test_requests_a_loop_cannot_serve_ride_along(srv, gen):
    """A request with logprobs and a sampled one decode beside greedy ones (single steps while they are
    active); the greedy ones still get the plain output."""
    def logprobs():
        r = srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=9, temperature=0, logprobs=2)
        return len(r.choices[0].logprobs.token_logprobs)

    def sampled():
        r = srv.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=9, temperature=1.0, seed=3)
        return r.usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(logprobs), pool.submit(sampled), pool.submit(_ask, srv, 1), pool.submit(_ask, srv, 2)]
        lp, n, g1, g2 = (j.result() for j in jobs)
    assert lp == 9 and 1 <= n <= 9
    assert (g1, g2) == (_plain(gen, *_case(1)), _plain(gen, *_case(2)))
    assert srv.wait_idle()


@pytest.mark.slow
def test_speculative_loops_give_plain_greedy_output(demo, gen, monkeypatch):
    """``speculative="mtp"`` with ``decode_loop=3``: greedy completions alone and concurrent equal plain greedy
    decoding, drafts are verified and some kept, and speculative device loops really ran. Slow (~30 s, a server
    of its own): the default run serves speculative device loops in tests/serve/test_serve_warmup.py
    (``mtp+loop``), checks the speculative loop's output against plain greedy in tests/infer/test_spec_loop.py and
    the server's speculative output in tests/serve/test_serve_speculative.py."""
    with running(demo, max_batch=4, max_len=512, prefill_chunk=64, speculative="mtp", decode_loop=3) as sp:
        sched, m = sp.scheduler, sp.server.metrics
        loops = []
        spec = sched.backend.speculative_greedy
        monkeypatch.setattr(sched.backend, "speculative_greedy", lambda *a: loops.append(a[2]) or spec(*a))
        want = [_plain(gen, *_case(i)) for i in range(8)]
        assert [_ask(sp, i) for i in range(4)] == want[:4]
        assert loops and set(loops) == {3} and m.drafted > 0 and m.accepted > 0
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(lambda i: _ask(sp, i), range(8))) == want
        assert sp.wait_idle()


def test_bad_decode_loop_is_refused(demo):
    from minimax_jax.serve.server import build
    with pytest.raises(ValueError, match="decode_loop"):
        build(demo, max_batch=2, max_len=128, decode_loop=0)
