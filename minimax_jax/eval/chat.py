"""MiniMax chat formatting for evaluation prompts (format from MODEL_FACTS.md section 1).

A chat-tuned MiniMax model expects ``]~!b[]~b]user\\n{text}[e~[\\n`` followed by the generation
prompt ``]~b]ai\\n<think>\\n``; its reply holds reasoning up to ``</think>`` and then the answer.
"""

from __future__ import annotations

import re

from minimax_jax.data.tokenizer import BOS, EOS, ROLE_START, THINK_CLOSE, THINK_OPEN


def chat_prompt(text: str, system: str | None = None) -> str:
    """Wraps ``text`` as one user turn plus the assistant generation prompt."""
    out = BOS
    if system is not None:
        out += f"{ROLE_START}system\n{system}{EOS}\n"
    return out + f"{ROLE_START}user\n{text}{EOS}\n{ROLE_START}ai\n{THINK_OPEN}\n"


_THINK = re.compile(re.escape(THINK_OPEN) + r".*?" + re.escape(THINK_CLOSE), flags=re.DOTALL)


def strip_thinking(output: str) -> str:
    """Removes ``<think>...</think>`` blocks and anything before a lone leading ``</think>``
    (the generation prompt already opened the block), and a trailing ``[e~[``."""
    if THINK_CLOSE in output and THINK_OPEN not in output.split(THINK_CLOSE, 1)[0]:
        output = output.split(THINK_CLOSE, 1)[1]
    output = _THINK.sub("", output)
    return output.split(EOS, 1)[0].strip()
