"""Prompts in and records out for ``python infer.py``: the ``--prompts_file`` JSONL reader and the
JSONL records (``--json`` / ``--output``).

Input, one JSON object per line (blank lines skipped)::

    {"prompt": "Once upon a time", "id": "a", "max_new_tokens": 32}
    {"messages": [{"role": "user", "content": "Hi"}], "tools": [...]}

Exactly one of ``prompt`` (text continued as is) or ``messages`` (chat, rendered with the MiniMax
template; ``tools`` and ``add_generation_prompt`` as in a ``--chat_file``); optional ``id`` (string
or integer, unique; default the prompt's 0-based index) and ``max_new_tokens`` (>= 1, overrides the
flag). Any other key is an error naming the line.

Output, one record per prompt and sample (``RECORD_KEYS``): ``id``, ``index`` (the prompt's position),
``sample`` (0-based), ``prompt_tokens`` (count), ``tokens`` (generated ids), ``text``, ``stop_reason``
(``STOP_REASONS``), ``stop_detail`` (the stop token id / stop string / repetition period, or null),
``logprobs`` (one float per token, with ``--logprobs``) and, for chat prompts, ``parsed`` (reasoning,
content, tool calls, malformed-tool-call errors).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

__all__ = ["PromptItem", "RECORD_KEYS", "RecordWriter", "STOP_REASONS", "make_record", "read_prompts_file",
           "with_context"]

#: Generation stop reasons -> record ``stop_reason``.
STOP_REASONS = {"stop_token": "eos", "stop_string": "stop_string", "length": "max_tokens",
                "repetition": "repetition", "interrupted": "interrupted"}
RECORD_KEYS = ("id", "index", "sample", "prompt_tokens", "tokens", "text", "stop_reason", "stop_detail")
_LINE_KEYS = {"prompt", "messages", "tools", "add_generation_prompt", "id", "max_new_tokens"}


@dataclasses.dataclass(frozen=True)
class PromptItem:
    """One prompt: ``text`` the model continues (a chat rendered), ``chat`` the ``ChatRequest`` or None,
    ``max_new_tokens`` None = the flag's; ``where`` names it in errors."""

    id: object
    index: int
    text: str
    chat: object = None
    max_new_tokens: int | None = None
    where: str = "the prompt"


def _chat(data: dict, where: str):
    from minimax_jax.chat import ChatFormatError, ChatRequest

    agp = data.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
        raise ChatFormatError(f"{where}: 'add_generation_prompt' must be true or false")
    req = ChatRequest(data["messages"], data.get("tools"), agp)
    try:
        return req, req.render()
    except ChatFormatError as e:
        raise ChatFormatError(f"{where}: {e}") from None


def parse_prompt_line(data, index: int, where: str) -> PromptItem:
    """A ``PromptItem`` from one decoded line (module doc). Raises ValueError / ChatFormatError."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
    unknown = sorted(set(data) - _LINE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed {sorted(_LINE_KEYS)}")
    if ("prompt" in data) == ("messages" in data):
        raise ValueError(f"{where}: give exactly one of 'prompt' (text) or 'messages' (chat)")
    pid = data.get("id", index)
    if isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise ValueError(f"{where}: 'id' must be a string or an integer, got {pid!r}")
    m = data.get("max_new_tokens")
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ValueError(f"{where}: 'max_new_tokens' must be an integer >= 1, got {m!r}")
    if "prompt" in data:
        if not isinstance(data["prompt"], str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        if "tools" in data or "add_generation_prompt" in data:
            raise ValueError(f"{where}: 'tools' / 'add_generation_prompt' go with 'messages', not 'prompt'")
        return PromptItem(pid, index, data["prompt"], None, m, where)
    req, text = _chat(data, where)
    return PromptItem(pid, index, text, req, m, where)


def read_prompts_file(path: str) -> list[PromptItem]:
    """Every prompt of a ``--prompts_file`` (module doc). Raises ValueError (unreadable, bad JSON, bad
    or duplicate fields, no prompt; the line is named) or ChatFormatError."""
    try:
        with open(path, encoding="utf-8-sig") as f:   # a leading byte-order mark is dropped
            lines = f.read().split("\n")      # JSONL lines end at "\n" only: U+2028 etc. may sit in strings
    except OSError as e:
        raise ValueError(f"cannot read --prompts_file {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts_file {path!r} is not UTF-8 text (byte {e.start})") from None
    items, seen = [], {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
        try:                        # a "\ud800" escape decodes to a lone surrogate, which no tokenizer takes
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                             "escape)") from None
        item = parse_prompt_line(data, len(items), where)
        if item.id in seen:
            raise ValueError(f"{where}: id {item.id!r} repeats the one on line {seen[item.id]}")
        seen[item.id] = n
        items.append(item)
    if not items:
        raise ValueError(f"--prompts_file {path!r} holds no prompt (one JSON object per line)")
    return items


def with_context(item: PromptItem, context: str) -> PromptItem:
    """``item`` with ``context`` put before its text (chat: at the start of the first user message).
    Raises ChatFormatError when a chat has no user message with text content."""
    from minimax_jax.chat import ChatFormatError, ChatRequest

    if item.chat is None:
        return dataclasses.replace(item, text=context + "\n\n" + item.text)
    msgs = [dict(m) for m in item.chat.messages]
    first = next((m for m in msgs if m.get("role") == "user"), None)
    if first is None or not isinstance(first.get("content"), str):
        raise ChatFormatError(f"{item.where}: --context_file needs a user message with text content")
    first["content"] = context + "\n\n" + first["content"]
    req = ChatRequest(msgs, item.chat.tools, item.chat.add_generation_prompt)
    return dataclasses.replace(item, text=req.render(), chat=req)


def make_record(item: PromptItem, sample: int, seq, prompt_tokens: int, *, logprobs: bool = False,
                parsed=None) -> dict:
    """The output record of ``seq`` (a ``SequenceResult``), sample ``sample`` of ``item`` (module doc)."""
    detail = seq.stop_detail
    rec = {"id": item.id, "index": item.index, "sample": sample, "prompt_tokens": prompt_tokens,
           "tokens": [int(t) for t in seq.tokens], "text": seq.text,
           "stop_reason": STOP_REASONS.get(seq.stop_reason, seq.stop_reason),
           "stop_detail": detail if detail is None or isinstance(detail, (str, int)) else str(detail)}
    if logprobs:
        rec["logprobs"] = [float(x) for x in seq.logprobs]
    if parsed is not None:
        rec["parsed"] = parsed.to_dict()
    return rec


class RecordWriter:
    """JSONL records to ``path`` (None = stdout), one line each, flushed per ``write``.

    A ``path`` that exists is refused unless ``overwrite``; one that is (or holds) a file of
    ``sources`` is always refused. Raises ValueError with the reason. Replacing an existing file, the
    records go to ``<path>.partial`` (``self.where``) and replace ``path`` only at ``close(complete=True)``: a
    run that is interrupted or fails keeps the old file, and its records so far stay in ``<path>.partial``.
    """

    def __init__(self, path: str | None, *, overwrite: bool = False, sources=()):
        self.path, self.count, self.where = path, 0, path
        if path is None:
            self._f = sys.stdout
            return
        for src in sources:
            if src and os.path.exists(src) and os.path.exists(path) and os.path.samefile(src, path):
                raise ValueError(f"--output {path!r} is the input file {src!r}; write the records elsewhere")
        if os.path.isdir(path):
            raise ValueError(f"--output {path!r} is a directory; give a file path")
        if os.path.exists(path) and not overwrite:
            raise ValueError(f"--output {path!r} exists; pass --overwrite to replace it, or choose another path")
        if os.path.exists(path):
            self.where = path + ".partial"
        try:
            self._f = open(self.where, "w" if overwrite else "x", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot write --output {self.where!r}: {e.strerror}") from None

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()
        self.count += 1

    def close(self, complete: bool = True) -> None:
        """Close the file; when replacing one, move the records into place if ``complete``, else keep the old
        file (and the records so far in ``self.where``, removed when there are none)."""
        if self._f is sys.stdout or self._f.closed:
            return
        self._f.close()
        if self.where != self.path:
            if complete:
                os.replace(self.where, self.path)
                self.where = self.path
            elif self.count == 0:
                os.remove(self.where)
