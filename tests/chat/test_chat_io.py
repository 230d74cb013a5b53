"""Loading chat JSON files."""

from __future__ import annotations
from tests.paths import REPO_ROOT

import json

import pytest

from minimax_jax.chat import ChatFormatError, load_chat_file, render_chat


def write(tmp_path, data, name="chat.json"):
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return p


def test_load_and_render(tmp_path):
    data = {"messages": [{"role": "user", "content": "Hi é"}],
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    req = load_chat_file(write(tmp_path, data))
    assert req.messages == data["messages"] and req.tools == data["tools"]
    assert req.add_generation_prompt
    assert req.render() == render_chat(data["messages"], data["tools"])


def test_generation_prompt_flag(tmp_path):
    req = load_chat_file(write(tmp_path, {"messages": [{"role": "user", "content": "x"}],
                                          "add_generation_prompt": False}))
    assert not req.render().endswith("<think>\n")


@pytest.mark.parametrize("data, match", [
    ("{not json", "not valid JSON"),
    ([], "top level must be an object"),
    ({"tools": []}, "missing 'messages'"),
    ({"messages": [], "extra": 1}, r"unknown keys \['extra'\]"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "message 0: unknown role"),
    ({"messages": [], "tools": [{}]}, "tool 0"),
    ({"messages": [], "add_generation_prompt": "yes"}, "true or false"),
])
def test_bad_files(tmp_path, data, match):
    p = write(tmp_path, data)
    with pytest.raises(ChatFormatError, match=match) as e:
        load_chat_file(p)
    assert str(p) in str(e.value)


def test_example_file_loads_and_renders():
    """The example in tests/fixtures/chat/ (OpenAI-style string arguments) loads and renders;
    the old trajectory's reasoning is dropped because a user turn follows it."""
    import pathlib
    path = pathlib.Path(REPO_ROOT) / "tests" / "fixtures" / "chat" / "agent_trajectory.json"
    req = load_chat_file(path)
    text = req.render()
    assert '<parameter name="days">1</parameter>' in text
    assert "<think>\nI should" not in text and "°C" in text
    assert text.endswith("]~b]user\nThanks![e~[\n]~b]ai\n<think>\n")
