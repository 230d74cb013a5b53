"""Unknown request fields are a 400 naming them (OpenAI-style error, code ``unknown_parameter``, the nearest known
name suggested), never silently ignored; the OpenAI bookkeeping fields listed in ``IGNORED_FIELDS`` (and ``user``)
are accepted. Checked on the request models and through the app (a stub scheduler: refused before any work)."""

import types

import pytest
from fastapi.testclient import TestClient

from minimax_jax.serve.app import build_app
from minimax_jax.serve.protocol import IGNORED_FIELDS, ApiError, ChatCompletionRequest, CompletionRequest
from tests import infer_helpers as H

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_request_models_name_unknown_fields():
    with pytest.raises(ApiError) as e:
        CompletionRequest(model="m", prompt="x", temprature=0.5, foo=1).unsupported()
    err = e.value.body()["error"]
    assert e.value.status == 400 and err["type"] == "invalid_request_error" and err["code"] == "unknown_parameter"
    assert err["param"] == "foo" and err["message"].startswith(
        "unrecognized request arguments supplied: 'foo', 'temprature' (did you mean 'temperature'?); this endpoint "
        "takes best_of, echo, ")
    CompletionRequest(model="m", prompt="x", user="u", top_k=3).unsupported()               # known / extensions
    ChatCompletionRequest(**CHAT, **{f: None for f in IGNORED_FIELDS}).unsupported()        # OpenAI's, ignored
    with pytest.raises(ApiError, match="'metadata'"):                                       # a chat field only
        CompletionRequest(model="m", prompt="x", metadata={}).unsupported()
    with pytest.raises(ApiError, match="'response_format'"):                  # OpenAI's, but it would change output
        ChatCompletionRequest(**CHAT, response_format={"type": "json_object"}).unsupported()


def test_the_app_answers_400_before_any_work():
    sched = types.SimpleNamespace(gen=types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=300)), max_len=64,
                                  alive=True, submit=lambda *_: pytest.fail("submitted"))
    client = TestClient(build_app(sched, H.tiny_tokenizer(), "m", metrics=None))
    r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_token": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_token"
    assert "(did you mean 'max_tokens'?)" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "tool_chioce": "auto"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    assert "'tool_chioce' (did you mean 'tool_choice'?)" in r.json()["error"]["message"]
