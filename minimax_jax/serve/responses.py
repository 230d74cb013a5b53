"""OpenAI response bodies and stream chunks from the scheduler's events.

Chat turns are split by ``minimax_jax.chat`` (the prompt ends inside ``<think>``): reasoning ->
``reasoning_content``, visible text -> ``content``, ``<minimax:tool_call>`` blocks -> ``tool_calls``
(``finish_reason`` "tool_calls" when there are any). Log-probability entries come from
``Scheduler`` (``{"id", "logprob", "top": [(id, logprob), ...]}``).
"""

from __future__ import annotations

import time
import uuid

from minimax_jax.chat import parse_model_output, split_reasoning
from minimax_jax.chat import tokens as T
from minimax_jax.stopping import held_back_length

__all__ = ["ChatDeltas", "chat_chunk", "chat_logprobs", "chat_message", "completion_logprobs", "new_id", "usage"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, done: list[dict]) -> dict:
    """Usage over the choices: the prompt counted once; ``cached_tokens`` from the prefix cache."""
    completion = sum(len(d["tokens"]) for d in done)
    cached = max((d["cached_tokens"] for d in done), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(entries: list[dict], piece, offset: int = 0) -> dict:
    """Legacy completions ``logprobs`` object; ``piece(id) -> str`` is a token's text."""
    tokens = [piece(e["id"]) for e in entries]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{piece(i): lp for i, lp in e["top"]} for e in entries], "text_offset": offsets}


def chat_logprobs(entries: list[dict], piece) -> dict:
    def one(i, lp):
        s = piece(i)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [dict(one(e["id"], e["logprob"]), top_logprobs=[one(i, lp) for i, lp in e["top"]])
                        for e in entries]}


def chat_message(text: str, tools) -> tuple[dict, bool]:
    """``(message, has_tool_calls)`` of a generated assistant turn."""
    parsed = parse_model_output(text, tools)
    msg = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning}
    calls = [c.to_openai(new_id("call")) for c in parsed.tool_calls]
    if calls:
        msg["tool_calls"] = calls
    return msg, bool(calls)


def chat_chunk(cid: str, created: int, model: str, index: int, delta: dict, finish_reason=None,
               logprobs=None) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


def now() -> int:
    return int(time.time())


class ChatDeltas:
    """Incremental split of a streamed assistant turn: ``update(text_so_far)`` -> the new
    ``reasoning_content`` / ``content`` pieces. A partial ``</think>``, content inside (or possibly
    starting) a tool-call block and trailing whitespace are held back; the tool calls come with the
    final chunk."""

    def __init__(self):
        self.reasoning = ""
        self.content = ""

    def update(self, text: str) -> dict:
        reasoning, rest, finished = split_reasoning(text)
        out = {}
        if reasoning is not None and not finished:   # a partly written "</think>" is held back
            reasoning = reasoning[:len(reasoning) - held_back_length(reasoning, (T.THINK_CLOSE,))].rstrip("\n")
        if reasoning is not None and len(reasoning) > len(self.reasoning) and reasoning.startswith(self.reasoning):
            out["reasoning_content"] = reasoning[len(self.reasoning):]
            self.reasoning = reasoning
        if reasoning is None or finished:
            i = rest.find(T.TOOL_CALL_OPEN)
            visible = rest[:i] if i >= 0 else rest[:len(rest) - held_back_length(rest, (T.TOOL_CALL_OPEN,))]
            visible = visible.strip()
            if len(visible) > len(self.content) and visible.startswith(self.content):
                out["content"] = visible[len(self.content):]
                self.content = visible
        return out

    def finish(self, message: dict) -> dict:
        """The pieces still missing from the final ``message`` (``chat_message``), e.g. held-back text."""
        out = {}
        for key, sent in (("reasoning_content", self.reasoning), ("content", self.content)):
            full = message.get(key) or ""
            if len(full) > len(sent) and full.startswith(sent):
                out[key] = full[len(sent):]
        return out
