"""MTP speculative decoding in the server (``build(speculative="mtp")``, the shipped demo model with its MTP
module) through the real ``openai`` client: greedy completions, alone and concurrent (mixed prompt lengths,
a chunked prefill, ``n`` = 2, a stop string), equal the plain (non-speculative) greedy generation loop;
drafts are really accepted; a request with penalties rides in the same batches without drafts; sampled
requests finish."""

from __future__ import annotations

import concurrent.futures

import pytest

from minimax_jax.infer.generation import GenerationConfig
from minimax_jax.infer.sampler import SamplingParams
from tests.serve.serving import running

MODEL = "demo"
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo, wherefore art thou", "def main(", "K",
           "FIRST CITIZEN:\nBefore we proceed any further, hear me speak. " * 6,         # > one 64-token chunk
           "import numpy as np\n", "MACBETH:\nIs this a dagger " * 3]


@pytest.fixture(scope="module")
def srv(demo):
    with running(demo, max_batch=4, max_len=512, prefill_chunk=64, speculative="mtp") as r:
        yield r


def _plain(gen, prompt: str, n: int, **sampling) -> str:
    cfg = GenerationConfig(max_new_tokens=n, sampling=SamplingParams(**sampling))
    return gen.generate_text([prompt], cfg).sequences[0].text


def _case(i: int) -> tuple[str, int]:
    return PROMPTS[i % len(PROMPTS)], 6 + 3 * (i % 4)


def _ask(srv, i: int) -> str:
    prompt, n = _case(i)
    return srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0).choices[0].text


def test_greedy_speculative_equals_plain_greedy(srv, gen):
    m = srv.server.metrics
    assert srv.scheduler.mtp is not None and srv.scheduler.mtp.k == 1
    drafted, accepted = m.drafted, m.accepted
    want = [_plain(gen, *_case(i)) for i in range(8)]
    assert [_ask(srv, i) for i in range(len(PROMPTS))] == want[:len(PROMPTS)]
    assert m.drafted > drafted and m.accepted > accepted                  # drafts verified, some kept
    with concurrent.futures.ThreadPoolExecutor(8) as pool:                 # > 4 slots: batched, some wait
        together = list(pool.map(lambda i: _ask(srv, i), range(8)))
    assert together == want
    r = srv.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, n=2)
    assert [c.text for c in r.choices] == [_plain(gen, PROMPTS[1], 12)] * 2
    full = _plain(gen, PROMPTS[1], 16)
    stop = full[8:10]
    r = srv.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    assert srv.wait_idle()


def test_penalised_and_sampled_requests_share_the_speculative_batch(srv, gen):
    kw = dict(model=MODEL, max_tokens=12)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        pen = pool.submit(srv.client.completions.create, prompt=PROMPTS[0], temperature=0, frequency_penalty=1.0, **kw)
        greedy = pool.submit(srv.client.completions.create, prompt=PROMPTS[2], temperature=0, **kw)
        sampled = pool.submit(srv.client.completions.create, prompt=PROMPTS[1], temperature=1.0, seed=3,
                              extra_body={"ignore_eos": True}, **kw)
        pen, greedy, sampled = pen.result(), greedy.result(), sampled.result()
    assert pen.choices[0].text == _plain(gen, PROMPTS[0], 12, frequency_penalty=1.0) != _plain(gen, PROMPTS[0], 12)
    assert greedy.choices[0].text == _plain(gen, PROMPTS[2], 12)
    assert sampled.usage.completion_tokens == 12
    assert srv.wait_idle()
