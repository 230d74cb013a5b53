"""Rendering of the MiniMax-M2 chat format: exact strings from MODEL_FACTS.md section 1, and
agreement with the published Jinja template (tests/fixtures/chat/README.md) on fixed and random
conversations."""

from __future__ import annotations
from tests.paths import REPO_ROOT

import json
import pathlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minimax_jax.chat import ChatFormatError, render_chat

FIXTURE = pathlib.Path(REPO_ROOT) / "tests" / "fixtures" / "chat" / "minimax_m2_chat_template.jinja"

# Pieces of the documented format (MODEL_FACTS.md section 1), written out independently of the
# renderer's own constants.
SYS = "]~!b[]~b]system\n{}[e~[\n"
USER = "]~b]user\n{}[e~[\n"
AI = "]~b]ai\n{}[e~[\n"
THINK = "<think>\n{}\n</think>\n\n"
GEN = "]~b]ai\n<think>\n"
DEFAULT_SYS = "You are a helpful assistant."

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city (é)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}


def call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def test_single_user_turn_with_default_system():
    got = render_chat([{"role": "user", "content": "Hello"}])
    assert got == SYS.format(DEFAULT_SYS) + USER.format("Hello") + GEN


def test_no_generation_prompt_and_system_message():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}]
    got = render_chat(msgs, add_generation_prompt=False)
    assert got == SYS.format("Be brief.") + USER.format("Hi") + AI.format("Hello.")


def test_reasoning_before_last_user_is_dropped_after_is_kept():
    msgs = [{"role": "user", "content": "Q1"},
            {"role": "assistant", "reasoning_content": "old thought", "content": "A1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "reasoning_content": "new thought", "content": "A2"}]
    got = render_chat(msgs, add_generation_prompt=False)
    assert got == (SYS.format(DEFAULT_SYS) + USER.format("Q1") + AI.format("A1")
                   + USER.format("Q2") + AI.format(THINK.format("new thought") + "A2"))


def test_inline_think_in_content_is_split_like_reasoning_content():
    inline = [{"role": "user", "content": "Q"},
              {"role": "assistant", "content": "<think>\nR\n</think>\n\nA"}]
    field = [{"role": "user", "content": "Q"},
             {"role": "assistant", "reasoning_content": "R", "content": "A"}]
    assert render_chat(inline) == render_chat(field)
    assert THINK.format("R") + "A" in render_chat(inline)


def test_inline_split_uses_first_and_last_close_tag():
    # Hub template rule (README.md item 3): reasoning before the first </think>, after the last
    # <think> in it; content after the last </think>; both stripped of newlines only.
    msgs = [{"role": "user", "content": "Q"},
            {"role": "assistant", "content": "x<think>\nR</think>\n\nA </think> B\n"}]
    assert render_chat(msgs, add_generation_prompt=False).endswith(
        AI.format(THINK.format("R") + " B"))
    old = msgs + [{"role": "user", "content": "Q2"}]
    assert AI.format(" B") + USER.format("Q2") in render_chat(old)


def test_agent_trajectory_with_tools_calls_and_results():
    msgs = [{"role": "system", "content": "S"},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "reasoning_content": "Need two calls.", "content": "",
             "tool_calls": [call("get_weather", city="Paris", days=2),
                            call("get_weather", city="Rome", extra={"unit": "C"})]},
            {"role": "tool", "tool_call_id": "1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "2", "content": "rain"},
            {"role": "assistant", "reasoning_content": "Summarise.", "content": "Sun and rain."}]
    got = render_chat(msgs, [WEATHER])
    tool_json = json.dumps(WEATHER["function"], ensure_ascii=False)
    system = ("S\n\n# Tools\nYou may call one or more tools to assist with the user query.\n"
              "Here are the tools available in JSONSchema format:\n\n<tools>\n"
              f"<tool>{tool_json}</tool>\n</tools>\n\n"
              "When making tool calls, use XML format to invoke tools and pass parameters:\n\n"
              "<minimax:tool_call>\n<invoke name=\"tool-name-1\">\n"
              "<parameter name=\"param-key-1\">param-value-1</parameter>\n"
              "<parameter name=\"param-key-2\">param-value-2</parameter>\n...\n</invoke>\n"
              "</minimax:tool_call>")
    calls = ("\n<minimax:tool_call>\n"
             "<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n"
             "<parameter name=\"days\">2</parameter>\n</invoke>\n"
             "<invoke name=\"get_weather\">\n<parameter name=\"city\">Rome</parameter>\n"
             "<parameter name=\"extra\">{\"unit\": \"C\"}</parameter>\n</invoke>\n"
             "</minimax:tool_call>")
    want = (SYS.format(system) + USER.format("Weather in Paris and Rome?")
            + AI.format(THINK.format("Need two calls.") + calls)
            + "]~b]tool\n<response>sunny</response>\n<response>rain</response>[e~[\n"
            + AI.format(THINK.format("Summarise.") + "Sun and rain.") + GEN)
    assert got == want
    assert "é" in got  # tool JSON keeps non-ASCII text


def test_openai_string_arguments_and_bare_tool_schema():
    a = render_chat([{"role": "user", "content": "x"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {
                             "name": "f", "arguments": '{"n": 1, "s": "t"}'}}]},
                     {"role": "tool", "content": "ok"}], [WEATHER["function"]])
    b = render_chat([{"role": "user", "content": "x"},
                     {"role": "assistant", "content": "", "tool_calls": [call("f", n=1, s="t")]},
                     {"role": "tool", "content": "ok"}], [WEATHER])
    assert a == b
    assert '<parameter name="n">1</parameter>\n<parameter name="s">t</parameter>' in a


@pytest.mark.parametrize("msgs, match", [
    ([{"role": "robot", "content": "x"}], "unknown role"),
    ([{"content": "x"}], "unknown role"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}],
     "without a preceding assistant tool call"),
    ([{"role": "user", "content": "x"},
      {"role": "assistant", "content": "", "tool_calls": [call("f")]},
      {"role": "user", "content": "y"}, {"role": "tool", "content": "r"}],
     "without a preceding assistant tool call"),
    ([{"role": "user", "content": "x"},
      {"role": "assistant", "content": "", "tool_calls": [call("f")]},
      {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}],
     "one result per call"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "s"}], "first message"),
    ([{"role": "user", "content": None}], "content must be"),
    ([{"role": "user", "content": [{"type": "image", "url": "u"}]}], "content part 0"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{bad"}}]}], "not valid JSON"),
    ([{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "[1]"}}]}], "must be an object"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}],
     "non-empty 'name'"),
    ([{"role": "assistant", "content": "", "reasoning_content": 3}], "reasoning_content"),
    ("not a list", "must be a list"),
])
def test_invalid_conversations_raise_clear_errors(msgs, match):
    with pytest.raises(ChatFormatError, match=match):
        render_chat(msgs)


@pytest.mark.parametrize("tools, match", [
    ([{"type": "function", "function": {"description": "no name"}}], "non-empty string 'name'"),
    ([WEATHER, WEATHER], "duplicate tool name"),
    ([{"name": "f", "parameters": "x"}], "'parameters' must be an object"),
    ({"name": "f"}, "must be a list"),
])
def test_invalid_tools_raise_clear_errors(tools, match):
    with pytest.raises(ChatFormatError, match=match):
        render_chat([{"role": "user", "content": "x"}], tools)


# ---------------------------------------------------------------- oracle: the published template

@pytest.fixture(scope="module")
def oracle():
    cu = pytest.importorskip("transformers.utils.chat_template_utils")
    lines = FIXTURE.read_text(encoding="utf-8").splitlines(keepends=True)
    # README.md item 1: drop the comment the community copy inserted after toolcall_end_token.
    kept = [ln for ln in lines if "Fix by ochafik" not in ln]
    assert len(kept) == len(lines) - 1
    template = cu._compile_jinja_template("".join(kept))

    def render(messages, tools=None, add_generation_prompt=True):
        return template.render(messages=messages, tools=tools,
                               add_generation_prompt=add_generation_prompt)
    return render


ORACLE_CASES = [
    ([{"role": "user", "content": "Hello"}], None),
    ([{"role": "system", "content": "Sys", "current_date": "2026-11-30",
       "current_location": "Уфа"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}],
     None),
    ([{"role": "system", "content": ""}, {"role": "user", "content": "q"},
      {"role": "assistant", "reasoning_content": "r1", "content": "ans"},
      {"role": "user", "content": "q2"},
      {"role": "assistant", "reasoning_content": "r2", "content": "x\n"}], None),
    ([{"role": "user", "content": "Weather?"},
      {"role": "assistant", "reasoning_content": "plan", "content": "Checking.",
       "tool_calls": [call("get_weather", city="Paris", days=3, flag=True, none=None,
                           nested={"a": [1, 2.5, "é"]})]},
      {"role": "tool", "content": "sunny"},
      {"role": "assistant", "reasoning_content": "", "content": "",
       "tool_calls": [call("get_weather", city="Rome"), call("get_weather")]},
      {"role": "tool", "content": [{"type": "text", "text": "t"}, {"output": "o"}, "s"]},
      {"role": "tool", "content": "second"},
      {"role": "assistant", "content": "Done.", "reasoning_content": "final"}], [WEATHER]),
    ([{"role": "assistant", "reasoning_content": "no user yet", "content": "hi"}], [WEATHER]),
]


@pytest.mark.parametrize("case", range(len(ORACLE_CASES)))
@pytest.mark.parametrize("gen", [True, False])
def test_matches_published_template(oracle, case, gen):
    msgs, tools = ORACLE_CASES[case]
    assert render_chat(msgs, tools, add_generation_prompt=gen) == oracle(msgs, tools, gen)


_FRAGMENTS = ["a", "Hé", " ", "\n", "\n\n", "<think>", "</think>", "{\"k\": 1}", "<b>", "'", "\""]
_text = st.lists(st.sampled_from(_FRAGMENTS), max_size=5).map("".join)
_json = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | _text
                     | st.floats(allow_nan=False, allow_infinity=False, width=32),
                     lambda ch: st.lists(ch, max_size=2)
                     | st.dictionaries(st.sampled_from(["x", "y"]), ch, max_size=2), max_leaves=4)
_args = st.dictionaries(st.sampled_from(["city", "days", "q", "opts"]), _json, max_size=3)


@st.composite
def conversations(draw):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(_text)})
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["user", "assistant", "call"]))
        if kind == "user":
            msgs.append({"role": "user", "content": draw(_text)})
            continue
        m = {"role": "assistant", "content": draw(_text)}
        if draw(st.booleans()):
            m["reasoning_content"] = draw(_text)
        else:  # README.md item 3: the oracle copy cannot split inline reasoning
            m["content"] = m["content"].replace("</think>", "")
        if kind == "call":
            calls = draw(st.lists(_args, min_size=1, max_size=2))
            m["tool_calls"] = [{"type": "function", "function": {"name": "get_weather",
                                                                 "arguments": a}} for a in calls]
            msgs.append(m)
            for _ in range(draw(st.integers(0, len(calls)))):
                msgs.append({"role": "tool", "content": draw(_text)})
        else:
            msgs.append(m)
    return msgs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=conversations(), with_tools=st.booleans(), gen=st.booleans())
def test_random_conversations_match_published_template(oracle, msgs, with_tools, gen):
    tools = [WEATHER] if with_tools else None
    assert render_chat(msgs, tools, add_generation_prompt=gen) == oracle(msgs, tools, gen)
