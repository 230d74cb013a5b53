"""Special strings of the MiniMax-M2 chat format (one place, shared by the renderer and parser).

Source: ``/work/shared/docs/MODEL_FACTS.md`` section 1 "Tokenizer and chat format" (token ids given
there for reference; this package works on text, the tokenizer maps these strings to single ids).
"""

from __future__ import annotations

BOS = "]~!b["  # id 200034: start of the whole conversation
ROLE_START = "]~b]"  # id 200019: starts every turn, followed by the role name and "\n"
TURN_END = "[e~["  # id 200020 (eos): ends every turn; the renderer puts "\n" after it
THINK_OPEN = "<think>"  # id 200050
THINK_CLOSE = "</think>"  # id 200051
TOOL_CALL_OPEN = "<minimax:tool_call>"  # id 200052
TOOL_CALL_CLOSE = "</minimax:tool_call>"  # id 200053

# Role names as they appear after ROLE_START in the rendered text.
RENDERED_ROLES = {"system": "system", "user": "user", "assistant": "ai", "tool": "tool"}

# Prompt that asks the model for a new assistant turn; the model continues inside <think>.
GENERATION_PROMPT = ROLE_START + "ai\n" + THINK_OPEN + "\n"

# System text used when the conversation has no (or an empty) system message.
DEFAULT_SYSTEM = "You are a helpful assistant."
