"""Per-request sampling adjustments of the server (shipped demo model): presence / frequency penalties and
``logit_bias`` (checked token by token against the raw top-20 log-probabilities adjusted in the test, and
against ``minimax_jax.infer``'s generation loop with the same penalties), several settings in ONE batch
each getting its own, and ``echo`` on ``/v1/completions``; bad values answered 400 naming the field."""

from __future__ import annotations

import threading

import openai
import pytest

from minimax_jax.infer.generation import GenerationConfig
from minimax_jax.infer.sampler import SamplingParams
from minimax_jax.serve.scheduler import Sequence
from tests.serve.serving import PREFILL_CHUNK, running

MODEL = "demo"
PROMPT = "ROMEO:"          # the demo model repeats "1222222, 122200, ..." greedily: penalties change it
E = 77                     # the token "e"


@pytest.fixture(scope="module")
def srv(demo):
    with running(demo, max_batch=8, max_len=512, prefill_chunk=PREFILL_CHUNK) as r:
        yield r


def _loop(gen, prompt: str, n: int, **penalties) -> list[int]:
    cfg = GenerationConfig(max_new_tokens=n, sampling=SamplingParams(**penalties), stop_token_ids=())
    return gen.generate_text([prompt], cfg).sequences[0].tokens


def _run_together(sched, prompt: list[int], n: int, settings: list[dict]) -> list[list[dict]]:
    """One ``submit`` of one greedy sequence per settings dict (so they are admitted and decoded in the
    same steps); each one's log-probability entries (top 20, raw model log-probabilities)."""
    entries = [[] for _ in settings]
    done = [threading.Event() for _ in settings]

    def sink(i):
        def emit(ev):
            if ev["type"] == "token":
                entries[i] += ev["logprobs"]
            else:
                assert ev["type"] == "done", ev
                done[i].set()
        return emit

    assert sched.active_count == 0 and sched.free_slots() >= len(settings)
    seqs = [Sequence(prompt, n, SamplingParams(presence_penalty=kw.get("presence", 0.0),
                                               frequency_penalty=kw.get("frequency", 0.0)),
                     sink(i), logprobs=20, ignore_eos=True, logit_bias=kw.get("bias")) for i, kw in enumerate(settings)]
    sched.submit(seqs)
    assert all(d.wait(120) for d in done)
    assert all(len(e) == n for e in entries)
    return entries


def _check_choice(entries: list[dict], presence=0.0, frequency=0.0, bias=None) -> int:
    """Every chosen token is the argmax of its step's raw top-20 log-probabilities adjusted here (OpenAI:
    ``- frequency * count - presence * (count > 0)`` over this choice's earlier tokens, ``+ bias``). Returns
    how many steps the adjustment changed the choice from the raw argmax."""
    counts, changed = {}, 0
    extra = dict(zip(*bias)) if bias else {}
    for e in entries:
        score = {t: lp + extra.get(t, 0.0) - frequency * counts.get(t, 0) - presence * (counts.get(t, 0) > 0)
                 for t, lp in e["top"]}
        best = max(score, key=lambda t: (score[t], -t))
        # a token outside the top 20 scores at most the 20th raw log-probability (+ a positive bias)
        outside = min(lp for _, lp in e["top"]) + max([0.0] + [b for t, b in extra.items()
                                                              if t not in score])
        assert score[best] > outside, e
        assert e["id"] == best, (e["id"], best, score)
        changed += best != e["top"][0][0]
        counts[e["id"]] = counts.get(e["id"], 0) + 1
    return changed


def test_settings_in_one_batch_each_get_their_own(srv, gen):
    """Greedy, two penalty settings and a logit bias decoded in the same steps: each follows its own
    adjusted logits; the plain one is unchanged (= the generation loop without penalties)."""
    sched, n = srv.scheduler, 20
    prompt = sched.gen.encode(PROMPT)
    plain, pen, neg, biased = _run_together(sched, prompt, n, [
        {}, {"presence": 0.5, "frequency": 1.0}, {"presence": -1.0, "frequency": -0.5}, {"bias": ([E], [100.0])}])
    assert [e["id"] for e in plain] == _loop(gen, PROMPT, n)
    assert _check_choice(plain) == 0
    assert _check_choice(pen, presence=0.5, frequency=1.0) > 0        # the penalties decided some steps
    _check_choice(neg, presence=-1.0, frequency=-0.5)
    assert [e["id"] for e in pen] == _loop(gen, PROMPT, n, presence_penalty=0.5, frequency_penalty=1.0)
    kinds = [len({e["id"] for e in es}) for es in (pen, plain, neg)]
    assert kinds[0] > kinds[1] >= kinds[2]                                # repeats discouraged / encouraged
    assert [e["id"] for e in biased] == [E] * n
    assert srv.wait_idle()


def test_penalties_through_the_client_equal_the_generation_loop(srv, gen, demo):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    plain = srv.client.completions.create(**kw).choices[0].text
    r = srv.client.completions.create(frequency_penalty=1.0, presence_penalty=0.5, **kw)
    want = gen.generate_text([PROMPT], GenerationConfig(max_new_tokens=16, sampling=SamplingParams(
        frequency_penalty=1.0, presence_penalty=0.5))).sequences[0]
    assert r.choices[0].text == want.text != plain
    c = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           temperature=0, logit_bias={str(E): 100})
    assert c.choices[0].message.reasoning_content == demo.tokenizer.decode([E] * 4)


def test_logit_bias_forces_and_bans_tokens(srv, demo):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    forced = srv.client.completions.create(logit_bias={str(E): 100}, **kw).choices[0].text
    assert forced == "e" * 6
    top = srv.client.completions.create(logprobs=2, **dict(kw, max_tokens=1)).choices[0].logprobs.top_logprobs[0]
    first, second = sorted(top, key=top.get, reverse=True)
    banned = demo.tokenizer.encode(first, add_special_tokens=False).ids
    assert len(banned) == 1
    r = srv.client.completions.create(logit_bias={str(banned[0]): -100}, logprobs=0, **dict(kw, max_tokens=1))
    assert r.choices[0].text == second


def test_echo_prepends_the_prompt(srv, demo):
    kw = dict(model=MODEL, max_tokens=8, temperature=0)
    plain = srv.client.completions.create(prompt=PROMPT, **kw).choices[0].text
    r = srv.client.completions.create(prompt=PROMPT, echo=True, n=2, **kw)
    assert [c.text for c in r.choices] == [PROMPT + plain] * 2
    assert r.usage.completion_tokens == 2 * srv.client.completions.create(prompt=PROMPT, **kw).usage.completion_tokens
    chunks = list(srv.client.completions.create(prompt=PROMPT, echo=True, stream=True, **kw))
    assert chunks[0].choices[0].text == PROMPT and "".join(c.choices[0].text for c in chunks) == PROMPT + plain
    ids = demo.tokenizer.encode(PROMPT, add_special_tokens=False).ids
    assert srv.client.completions.create(prompt=ids, echo=True, **kw).choices[0].text == PROMPT + plain
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(prompt=PROMPT, echo=True, logprobs=1, **kw)
    assert e.value.param == "echo" and "echo with logprobs is not supported" in e.value.message


@pytest.mark.parametrize("kw, param, words", [
    (dict(logit_bias={"abc": 1}), "logit_bias", ["'abc'", "not a token id"]),
    (dict(logit_bias={"5": 101}), "logit_bias", ["'5'", "101", "[-100, 100]"]),
    (dict(logit_bias={"5": "x"}), "logit_bias", ["'5'", "'x'"]),
    (dict(logit_bias={"99999": 1}), "logit_bias", ["'99999'", "[0, 2048)"]),
    (dict(presence_penalty=2.5), "presence_penalty", ["presence_penalty"]),
    (dict(frequency_penalty=-3), "frequency_penalty", ["frequency_penalty"]),
])
def test_bad_sampling_adjustments_are_400_naming_them(srv, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **kw)
    assert e.value.status_code == 400 and e.value.param == param
    for w in words:
        assert w in e.value.message, e.value.message


def test_logit_bias_arrays():
    from minimax_jax.serve.protocol import CompletionRequest

    assert CompletionRequest(model="m", prompt="x").logit_bias_arrays(10) is None
    assert CompletionRequest(model="m", prompt="x", logit_bias={"3": -2, "0": 1.5}).logit_bias_arrays(10) == (
        [3, 0], [-2.0, 1.5])
