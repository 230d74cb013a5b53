"""What ``python infer.py`` prints on stdout: text with the prompt and each generation marked off,
or nothing but JSONL records (``--json``); the records can also go to a file (``--output``).

Text layout, per prompt (the prompt part unless ``--noecho_prompt``; numbers and ids only when
there are several prompts / samples)::

    --- prompt 2/3 (id: b) ---
    <prompt text>
    --- generation 2/3 (id: b), sample 1/2 ---
    <generated text>
    --- parsed output (JSON) ---          (chat prompts only)
    {...}
"""

from __future__ import annotations

import sys

from minimax_jax.infer.prompts_io import RecordWriter, make_record

__all__ = ["Output", "PARSED_MARKER"]

PARSED_MARKER = "--- parsed output (JSON) ---"


class Output:
    """Stdout (text, or records with ``json``) and an optional records file, for ``total`` prompts x ``n``
    samples. ``start`` / ``delta`` stream one row; ``done`` finishes it (prints what was not streamed)."""

    def __init__(self, *, total: int, n: int, json: bool, echo: bool, output: str | None = None,
                 overwrite: bool = False, sources=(), logprobs: bool = False, out=None):
        self.total, self.n, self.echo, self.logprobs = total, n, echo, logprobs
        self.out = out or sys.stdout
        self.json = RecordWriter(None) if json else None
        self.file = RecordWriter(output, overwrite=overwrite, sources=sources) if output else None
        self._echoed: set = set()
        self._streaming = False
        self.records = 0

    def _label(self, item) -> str:
        if self.total == 1:
            return ""
        return f" {item.index + 1}/{self.total}" + (f" (id: {item.id})" if item.id != item.index else "")

    def _headers(self, item, sample: int) -> None:
        if self.echo and item.index not in self._echoed:
            self._echoed.add(item.index)
            self.out.write(f"--- prompt{self._label(item)} ---\n{item.text}\n")
        s = f", sample {sample + 1}/{self.n}" if self.n > 1 else ""
        self.out.write(f"--- generation{self._label(item)}{s} ---\n")

    def start(self, item, sample: int) -> None:
        """Before a streamed row: its headers."""
        if self.json is None:
            self._headers(item, sample)
            self.out.flush()
            self._streaming = True

    def delta(self, text: str) -> None:
        if self.json is None:
            self.out.write(text)
            self.out.flush()

    def done(self, item, sample: int, seq, prompt_tokens: int, parsed=None) -> None:
        """A finished row: its text (unless streamed) or its record; ``parsed``: the chat turn."""
        rec = make_record(item, sample, seq, prompt_tokens, logprobs=self.logprobs, parsed=parsed)
        for w in (self.json, self.file):
            if w is not None:
                w.write(rec)
        self.records += 1
        if self.json is not None:
            return
        if not self._streaming:
            self._headers(item, sample)
            self.out.write(seq.text)
        self._streaming = False
        self.out.write("\n")
        if parsed is not None:
            self.out.write(PARSED_MARKER + "\n" + parsed.to_json(indent=2) + "\n")
        self.out.flush()

    def interrupted_row(self) -> None:
        """End a streamed row cut short (the text so far stays, followed by a newline)."""
        if self._streaming:
            self.out.write("\n")
            self.out.flush()
            self._streaming = False

    def close(self, complete: bool = True) -> None:
        """Close the outputs; ``complete`` False (interrupted or failed) keeps a replaced ``--output`` file."""
        for w in (self.json, self.file):
            if w is not None:
                w.close(complete)
