"""``infer.py`` prompt assembly from the flags: --prompt / --prompt_file / --chat_file, --context_file."""

import json

import pytest
from absl import flags

from minimax_jax.chat import ChatFormatError, render_chat
from minimax_jax.infer import cli


@pytest.fixture
def parse():
    def go(*args):
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["infer.py", *args])

    yield go
    flags.FLAGS.unparse_flags()


def test_prompt_and_context(parse, tmp_path):
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("A long document.")
    parse("--prompt=Question?", f"--context_file={ctx}")
    assert cli.build_prompt() == ("A long document.\n\nQuestion?", None)
    pf = tmp_path / "p.txt"
    pf.write_text("From a file")
    parse(f"--prompt_file={pf}")
    assert cli.build_prompt() == ("From a file", None)


def test_chat_with_context_goes_into_first_user_message(parse, tmp_path):
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who?"}]}
    cf, ctx = tmp_path / "c.json", tmp_path / "ctx.txt"
    cf.write_text(json.dumps(chat))
    ctx.write_text("Doc.")
    parse(f"--chat_file={cf}", f"--context_file={ctx}")
    text, req = cli.build_prompt()
    want = [chat["messages"][0], {"role": "user", "content": "Doc.\n\nWho?"}]
    assert text == render_chat(want) and req.messages == want


def test_prompt_source_errors(parse, tmp_path):
    parse()
    with pytest.raises(ValueError, match="give exactly one of --prompt, --prompt_file, --chat_file"):
        cli.build_prompt()
    parse("--prompt=a", "--prompt_file=b")
    with pytest.raises(ValueError, match="got --prompt, --prompt_file"):
        cli.build_prompt()
    parse(f"--prompt_file={tmp_path / 'missing.txt'}")
    with pytest.raises(ValueError, match="cannot read --prompt_file"):
        cli.build_prompt()
    cf = tmp_path / "c.json"
    cf.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}))
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("Doc.")
    parse(f"--chat_file={cf}", f"--context_file={ctx}")
    with pytest.raises(ChatFormatError, match="needs a user message with text content"):
        cli.build_prompt()
