"""The server through the real ``openai`` client (uvicorn on a loopback port, the shipped demo model):
completions, chat (reasoning, a tool round trip accepted), streaming, ``n``, stops, logprobs, the
prefix cache across requests, errors, /v1/models, /health, /metrics. Greedy and seeded outputs are
checked against ``minimax_jax.infer``'s generation loop for the same prompt."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import openai
import pytest

from minimax_jax.chat import render_chat
from minimax_jax.infer.generation import GenerationConfig, Generator
from minimax_jax.infer.sampler import SamplingParams
from tests.serve.serving import PREFILL_CHUNK, running

MODEL = "demo"


@pytest.fixture(scope="module")
def srv(demo):
    with running(demo, max_batch=8, max_len=512, prefill_chunk=PREFILL_CHUNK) as r:
        yield r


def _reference(gen, prompt: str, max_new_tokens: int, **kw):
    return gen.generate_text([prompt], GenerationConfig(max_new_tokens=max_new_tokens, **kw)).sequences[0]


def _get(srv, path: str):
    with urllib.request.urlopen(srv.base + path, timeout=30) as r:
        return r.status, r.headers.get("content-type", ""), r.read().decode()


def test_greedy_completion_equals_the_generation_loop(srv, gen):
    want = _reference(gen, "ROMEO:", 12)
    r = srv.client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.tokens) and r.usage.prompt_tokens == len(gen.encode("ROMEO:"))
    assert r.choices[0].finish_reason == {"length": "length"}.get(want.stop_reason, "stop")


@pytest.fixture(scope="module")
def gen8(demo):
    """The generation loop with the server's engine shape (8 slots of 512 tokens, its prefill chunk)."""
    g = Generator(demo.cfg, demo.params, demo.tokenizer, engine_options={"prefill_chunk": PREFILL_CHUNK})
    g.reserve(8, 512)
    return g


def test_sampled_n2_equals_the_generation_loop_per_sample(srv, gen8):
    # Compared with a loop of the server's 8 slots: another batch shape rounds bf16 differently and can flip a
    # near-tie (session 43: "JULIET:\nO Romeo, Romeo" has an MoE routing tie at its last token that 2 and 8 slots
    # break differently). This prompt and seed sample the same with 2 and 8 slots, and top_p 0.9 changes both
    # choices (checked below), so a server that dropped top_p, top_k, the seed or the choice order would fail.
    p = "ROMEO:\nBut soft"
    kw = dict(temperature=1.0, top_k=40, seed=7)
    def loop(top_p):
        cfg = GenerationConfig(max_new_tokens=10, sampling=SamplingParams(top_p=top_p, **kw))
        return gen8.generate_text([p, p], cfg, row_ids=[0, 1]).sequences

    want, unfiltered = loop(0.9), loop(1.0)
    assert all(a.text != b.text for a, b in zip(want, unfiltered))
    r = srv.client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=1.0, top_p=0.9, seed=7, n=2,
                                      extra_body={"top_k": 40})
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [s.text for s in want]
    assert r.usage.completion_tokens == sum(len(s.tokens) for s in want)


def test_logprobs_match_the_generation_loop(srv, gen):
    want = _reference(gen, "def main(", 6, logprobs=True)
    r = srv.client.completions.create(model=MODEL, prompt="def main(", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(want.tokens) == len(lp.top_logprobs)
    # the demo model computes in bfloat16 and the server's engine has another static batch (8 slots, not 1):
    # the same tokens, log-probabilities within bf16 rounding (a wrong token's would be off by far more)
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=0.05)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-6)   # greedy: the top token
    assert "".join(lp.tokens) == r.choices[0].text


def test_stop_string_cuts_the_text(srv):
    full = srv.client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=12, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop
    r = srv.client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=12, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_streamed_completion_equals_the_whole_one(srv):
    kw = dict(model=MODEL, prompt="KING HENRY:", max_tokens=10, temperature=0)
    whole = srv.client.completions.create(**kw)
    chunks = list(srv.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_reasoning_and_a_tool_round_trip(srv, gen):
    """A tool result after an assistant tool call is accepted and rendered with the MiniMax template:
    the chat reply is the completion of ``render_chat``'s prompt (413 tokens: a chunked prefill)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    prompt = render_chat(messages, tools)
    want = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0]
    r = srv.client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(gen.encode(prompt)) > 256
    m = r.choices[0].message
    assert m.role == "assistant" and not m.tool_calls
    # the turn starts inside <think>: the demo model never closes it, so everything is reasoning
    assert "</think>" not in want.text
    assert m.reasoning_content == want.text.strip("\n") and m.content == ""
    chunks = list(srv.client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=8,
                                                     temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert streamed == m.reasoning_content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_prefix_cache_is_reused_across_requests(srv, demo):
    prompt = "FIRST CITIZEN:\nBefore we proceed any further, hear me speak. " * 8
    n = len(demo.tokenizer.encode(prompt, add_special_tokens=False).ids)
    assert n > 2 * 64
    a = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    b = srv.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert a.usage.prompt_tokens_details.cached_tokens == 0 or a.usage.prompt_tokens_details.cached_tokens < n
    assert b.usage.prompt_tokens_details.cached_tokens == 64 * ((n - 1) // 64)
    assert b.choices[0].text == a.choices[0].text


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=5.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"), (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(logprobs=99), "logprobs"),
])
def test_bad_parameters_are_400_with_a_message(srv, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model=MODEL, prompt="ROMEO:", **{"max_tokens": 4, **kw})
    assert e.value.status_code == 400 and e.value.param == param and e.value.type == "invalid_request_error"
    assert param in e.value.message


def test_over_long_prompt_and_bad_chat_are_400_unknown_model_404(srv):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model=MODEL, prompt="ROMEO: " * 400, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and "maximum context length is 512" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "x"}], max_tokens=4)
    assert e.value.param == "messages" and "message 0" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:         # no message at all (OpenAI: 400 too)
        srv.client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    assert e.value.param == "messages" and "messages is empty" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        srv.client.completions.create(model="nope", prompt="ROMEO:", max_tokens=4)
    assert e.value.code == "model_not_found" and "nope" in e.value.message


@pytest.mark.parametrize("body, code, message", [
    (b'{"model": "demo", "prompt": "x",', "invalid_json",
     "the request body is not valid JSON: Expecting property name enclosed in double quotes at character 32"),
    (b"not json", "invalid_json", "the request body is not valid JSON: Expecting value at character 0"),
    (b"[1, 2]", "invalid_value", "the request body must be a JSON object"),
    (b'{"model": "demo"}', "invalid_value", "prompt: Field required"),
    (b"", "invalid_json", "the request body is empty: expected a JSON object"),
    (b'{"model": "demo", "prompt": "\xff\xfe"}', "invalid_json",
     "the request body is not valid JSON (it could not be parsed: not UTF-8 or nested too deeply)"),
    (b'{"model": "demo", "prompt": "x", "top_k": 3000000000}', "invalid_value",
     "top_k: Input should be less than or equal to 2147483647"),
    (b'{"model": "demo", "prompt": "x", "seed": -5}', "invalid_value",
     "seed: Input should be greater than or equal to 0"),
    (b'{"model": "demo", "prompt": "x", "temperature": NaN}', "invalid_value",
     "temperature: Input should be a finite number"),
    (b'{"model": "demo", "prompt": "x"}', "invalid_value", "Content-Type must be application/json (got 'text/plain')"),
])
def test_malformed_bodies_are_400_with_a_readable_message(srv, body, code, message):
    ctype = "text/plain" if "Content-Type" in message else "application/json"
    req = urllib.request.Request(srv.base + "/v1/completions", data=body, headers={"Content-Type": ctype})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400
    err = json.loads(e.value.read().decode())["error"]
    assert err["code"] == code and err["message"] == message and err["type"] == "invalid_request_error", err
    ok = srv.client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=2, temperature=0)   # still serving
    assert ok.usage.completion_tokens >= 1


def test_full_queue_is_429(srv):
    old, srv.scheduler.max_queue = srv.scheduler.max_queue, 0
    try:
        with pytest.raises(openai.RateLimitError) as e:
            srv.client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=4)
        assert e.value.status_code == 429 and "busy" in e.value.message
    finally:
        srv.scheduler.max_queue = old


def test_models_health_and_metrics(srv):
    assert [m.id for m in srv.client.models.list().data] == [MODEL]
    status, _, body = _get(srv, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    srv.client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=3, temperature=0)
    status, ctype, body = _get(srv, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    values = {}
    for line in body.splitlines():
        if line.startswith("#") or not line:
            continue
        m = re.fullmatch(r'([a-z_]+)(\{[a-z]+="[^"]*"\})? (\S+)', line)
        assert m, line
        values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    p = "minimax_serve_"
    assert values[p + "time_to_first_token_seconds_count"] >= 1
    assert values[p + 'time_to_first_token_seconds_bucket{le="+Inf"}'] == values[p + "time_to_first_token_seconds_count"]
    assert values[p + "inter_token_latency_seconds_count"] >= 2
    assert values[p + "generated_tokens_total"] >= 3 and values[p + "queue_length"] == 0
    assert 0.0 <= values[p + "prefix_cache_hit_rate"] <= 1.0 and values[p + "tokens_per_second"] >= 0
