"""Tool-call parsing: well-formed and broken XML, typed arguments, reasoning/content split,
round trip through the renderer, and the streaming helper."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minimax_jax.chat import (ArgumentTypeError, convert_argument, ends_inside_tool_call,
                              parse_model_output, render_chat, tool_call_state)

TOOLS = [{"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "top_k": {"type": "integer"},
        "threshold": {"type": "number"}, "safe": {"type": "boolean"},
        "filters": {"type": "object"}, "tags": {"type": "array"},
        "limit": {"type": ["integer", "null"]}, "id": {"anyOf": [{"type": "integer"},
                                                                 {"type": "string"}]}}}}},
    {"name": "noop"}]


def block(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


def invoke(name: str, **params: str) -> str:
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items())
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def test_reasoning_content_and_typed_call():
    text = ("The user wants a search.\n</think>\n\nLet me look.\n"
            + block(invoke("search", query='print("hi")\nline 2', top_k="5", threshold="0.25",
                           safe="true", filters='{"a": 1.5, "b": [1, null]}', tags='["x"]',
                           limit="null", id="abc"))
            + "[e~[")
    out = parse_model_output(text, TOOLS)
    assert out.reasoning == "The user wants a search."
    assert out.reasoning_finished
    assert out.content == "Let me look."
    assert out.errors == ()
    assert len(out.tool_calls) == 1
    c = out.tool_calls[0]
    assert c.name == "search"
    assert c.arguments == {"query": 'print("hi")\nline 2', "top_k": 5, "threshold": 0.25,
                           "safe": True, "filters": {"a": 1.5, "b": [1, None]}, "tags": ["x"],
                           "limit": None, "id": "abc"}
    assert type(c.arguments["top_k"]) is int
    # printable as JSON, and as an OpenAI tool call
    assert json.loads(out.to_json())["tool_calls"][0]["arguments"]["safe"] is True
    assert json.loads(c.to_openai("id1")["function"]["arguments"]) == c.arguments


def test_without_tools_values_stay_strings_and_multiple_invokes():
    text = "r</think>" + block(invoke("a", n="1"), invoke("b", flag="true"))
    out = parse_model_output(text)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("a", {"n": "1"}),
                                                                ("b", {"flag": "true"})]
    assert out.content == "" and out.errors == ()


def test_output_without_thinking_and_with_explicit_think_tag():
    plain = parse_model_output("Just text.", thinking_open=False)
    assert (plain.reasoning, plain.content, plain.tool_calls) == (None, "Just text.", ())
    tagged = parse_model_output("<think>\nR\n</think>\n\nA", thinking_open=False)
    assert (tagged.reasoning, tagged.content) == ("R", "A")


def test_unfinished_reasoning_is_reported_not_raised():
    out = parse_model_output("still thinking <minimax:tool_call> about tags")
    assert out.reasoning == "still thinking <minimax:tool_call> about tags"
    assert not out.reasoning_finished and out.tool_calls == () and out.errors == ()


def test_tool_call_tags_inside_reasoning_are_not_calls():
    text = "I could " + block(invoke("search", query="x")) + "\n</think>\n\nNo call."
    out = parse_model_output(text, TOOLS)
    assert out.tool_calls == () and out.content == "No call." and out.errors == ()


@pytest.mark.parametrize("body, kind", [
    ("<minimax:tool_call>\n" + invoke("search", query="x"), "unclosed_tool_call"),
    (block('<invoke name="search">\n<parameter name="query">x</parameter>\n'),
     "unclosed_invoke"),
    (block('<invoke>\n<parameter name="query">x</parameter>\n</invoke>\n'), "missing_name"),
    (block('<invoke name="">\n</invoke>\n'), "missing_name"),
    (block('<invoke name="search">\n<parameter>x</parameter>\n</invoke>\n'), "missing_name"),
    (block('<invoke name="search">\n<parameter name="query">x\n</invoke>\n'),
     "unclosed_parameter"),
    (block(invoke("search", top_k="five")), "bad_argument"),
    (block(invoke("search", top_k="3.0")), "bad_argument"),
    (block(invoke("search", threshold="NaN")), "bad_argument"),
    (block(invoke("search", safe="yes")), "bad_argument"),
    (block(invoke("search", filters="{'a': 1}")), "bad_argument"),
    (block(invoke("search", filters="[1]")), "bad_argument"),
    (block(invoke("search", limit="x")), "bad_argument"),
    (block(invoke("unknown_tool", a="1")), "unknown_tool"),
    (block('<invoke name="search">\n<parameter name="query">a</parameter>\n'
           '<parameter name="query">b</parameter>\n</invoke>\n'), "duplicate_parameter"),
])
def test_malformed_calls_become_error_entries(body, kind):
    out = parse_model_output("r</think>\n\nBefore.\n" + body + "[e~[", TOOLS)
    assert out.tool_calls == ()
    assert [e.kind for e in out.errors] == [kind]
    err = out.errors[0]
    assert err.message and err.raw
    json.dumps(err.to_dict())  # structured and printable
    assert out.content.startswith("Before.")


def test_bad_call_does_not_hide_good_calls_and_stray_text_is_reported():
    text = ("r</think>" + block(invoke("search", top_k="x"), "junk\n", invoke("search", top_k="2"))
            + "\nAfter </minimax:tool_call> end")
    out = parse_model_output(text, TOOLS)
    assert [c.arguments for c in out.tool_calls] == [{"top_k": 2}]
    assert sorted(e.kind for e in out.errors) == ["bad_argument", "unexpected_text",
                                                  "unmatched_close"]
    bad = next(e for e in out.errors if e.kind == "bad_argument")
    assert (bad.name, bad.parameter) == ("search", "top_k")
    assert out.content == "After  end"


def test_unclosed_block_followed_by_good_block():
    text = "r</think><minimax:tool_call>\n<invoke name=\"search\">" + block(invoke("noop"))
    out = parse_model_output(text, TOOLS)
    assert [c.name for c in out.tool_calls] == ["noop"]
    assert [e.kind for e in out.errors] == ["unclosed_tool_call"]


def test_quoting_variants_of_name_attribute():
    text = "r</think><minimax:tool_call><invoke name='search'><parameter name=top_k>7</parameter>" \
           "</invoke></minimax:tool_call>"
    out = parse_model_output(text, TOOLS)
    assert out.errors == () and out.tool_calls[0].arguments == {"top_k": 7}


def test_convert_argument_table():
    assert convert_argument(" 42 ", {"type": "integer"}) == 42
    assert convert_argument("-3", {"type": "number"}) == -3
    assert convert_argument("1e3", {"type": "number"}) == 1000.0
    assert convert_argument("False", {"type": "boolean"}) is False
    assert convert_argument("12", {"type": ["integer", "string"]}) == 12
    assert convert_argument("twelve", {"type": ["integer", "string"]}) == "twelve"
    assert convert_argument("007", {"type": "string"}) == "007"
    assert convert_argument("x", {"enum": ["x"]}) == "x"
    assert convert_argument("{}", None) == "{}"
    with pytest.raises(ArgumentTypeError, match="integer"):
        convert_argument("1.5", {"type": "integer"})
    with pytest.raises(ArgumentTypeError, match="number"):
        convert_argument("true", {"type": "number"})


_values = st.fixed_dictionaries({}, optional={
    "query": st.text(st.characters(blacklist_characters="<\r", blacklist_categories=["Cs"]),
                     max_size=12).filter(lambda s: not s.startswith("\n") and not s.endswith("\n")),
    "top_k": st.integers(-10**9, 10**9),
    "threshold": st.floats(allow_nan=False, allow_infinity=False),
    "safe": st.booleans(),
    "filters": st.dictionaries(st.sampled_from(["a", "b"]), st.integers() | st.none(), max_size=2),
    "tags": st.lists(st.text(max_size=3), max_size=3),
})


@settings(max_examples=50, deadline=None)
@given(args=st.lists(_values, min_size=1, max_size=3), content=st.sampled_from(["", "Sure."]))
def test_render_then_parse_round_trip(args, content):
    """The assistant turn our renderer writes parses back to the same calls and content."""
    calls = [{"type": "function", "function": {"name": "search", "arguments": a}} for a in args]
    prompt = render_chat([{"role": "user", "content": "q"},
                          {"role": "assistant", "reasoning_content": "R", "content": content,
                           "tool_calls": calls}], TOOLS, add_generation_prompt=False)
    turn = prompt.split("]~b]ai\n<think>\n", 1)[1]
    out = parse_model_output(turn, TOOLS)
    assert out.errors == ()
    assert (out.reasoning, out.content) == ("R", content)
    assert [c.arguments for c in out.tool_calls] == args


@pytest.mark.parametrize("text, state", [
    ("thinking <minimax:tool_call>", "reasoning"),
    ("r</think>\n\nHello", "content"),
    ("r</think>\n\nHello <", "partial_tag"),
    ("r</think>\n\nHello <minimax:tool", "partial_tag"),
    ("r</think>\n\n<minimax:tool_call>\n<invoke name=\"f\">", "in_tool_call"),
    ("r</think>" + block(invoke("f")), "content"),
    ("r</think>" + block(invoke("f")) + "\n<minimax:tool_call>", "in_tool_call"),
    ("r <minimax:tool_call></think>\n\nok", "content"),
])
def test_streaming_state(text, state):
    assert tool_call_state(text) == state
    assert ends_inside_tool_call(text) == (state in ("in_tool_call", "partial_tag"))


def test_streaming_state_without_thinking():
    assert tool_call_state("<minimax:tool_call>\n", thinking_open=False) == "in_tool_call"
    assert tool_call_state("plain", thinking_open=False) == "content"


def test_parameter_value_loses_exactly_one_newline_each_side():
    text = ('r</think><minimax:tool_call>\n<invoke name="search">\n'
            '<parameter name="query">\nline\n</parameter>\n'
            '<parameter name="filters">\n\n{"a": 1}\n\n</parameter>\n'
            '</invoke>\n</minimax:tool_call>')
    out = parse_model_output(text, TOOLS)
    assert out.errors == ()
    assert out.tool_calls[0].arguments == {"query": "line", "filters": {"a": 1}}
    raw = parse_model_output(text.replace('"filters"', '"other"'), TOOLS).tool_calls[0]
    assert raw.arguments["other"] == "\n{\"a\": 1}\n"  # undeclared parameter: string kept
