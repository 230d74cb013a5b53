"""``infer.py`` prompt assembly from the flags: --prompt / --prompt_file / --chat_file / --prompts_file,
--context_file."""

import json

import pytest
from minimax_jax.chat import ChatFormatError, render_chat
from minimax_jax.infer import cli


@pytest.fixture
def parse():
    def go(*args):
        cli.parse(list(args))

    yield go


def test_prompt_and_context(parse, tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("A long document.")
    parse("--prompt=Question?", f"--context_file={ctx}")
    assert _one() == ("A long document.\n\nQuestion?", None)
    pf = tmp_path / "p.txt"
    pf.write_text("From a file")
    parse(f"--prompt_file={pf}")
    assert _one() == ("From a file", None)


def _one():
    (item,) = cli.build_items()
    return item.text, item.chat


def test_prompts_file_with_context(parse, tmp_path):
    ctx, pf = tmp_path / "ctx.txt", tmp_path / "p.jsonl"
    ctx.write_text("Doc.")
    chat = [{"role": "user", "content": "Who?"}]
    pf.write_text(json.dumps({"prompt": "Q1", "id": "a", "max_new_tokens": 3}) + "\n"
                  + json.dumps({"messages": chat}) + "\n")
    parse(f"--prompts_file={pf}", f"--context_file={ctx}")
    a, b = cli.build_items()
    assert (a.id, a.index, a.text, a.chat, a.max_new_tokens) == ("a", 0, "Doc.\n\nQ1", None, 3)
    want = [{"role": "user", "content": "Doc.\n\nWho?"}]
    assert (b.id, b.index, b.text, b.chat.messages, b.max_new_tokens) == (1, 1, render_chat(want), want, None)


def test_chat_with_context_goes_into_first_user_message(parse, tmp_path):
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]}
    cf, ctx = tmp_path / "c.json", tmp_path / "ctx.txt"
    cf.write_text(json.dumps(chat))
    ctx.write_text("Doc.")
    parse(f"--chat_file={cf}", f"--context_file={ctx}")
    text, req = _one()
    want = [chat["messages"][0], {"role": "user", "content": "Doc.\n\nWho?"}]
    assert text == render_chat(want) and req.messages == want


def test_prompt_source_errors(parse, tmp_path):
    parse()
    with pytest.raises(ValueError, match="give exactly one of --prompt, --prompt_file, --chat_file, --prompts_file"):
        cli.build_items()
    parse("--prompt=a", "--prompts_file=b")
    with pytest.raises(ValueError, match="got --prompt, --prompts_file"):
        cli.build_items()
    parse(f"--prompt_file={tmp_path / 'missing.txt'}")
    with pytest.raises(ValueError, match="cannot read --prompt_file"):
        cli.build_items()
    cf = tmp_path / "c.json"
    cf.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}))
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("Doc.")
    parse(f"--chat_file={cf}", f"--context_file={ctx}")
    with pytest.raises(ChatFormatError, match=f"{cf}: --context_file needs a user message with text content"):
        cli.build_items()
