"""MiniMax-M2 chat format: prompt rendering, chat files, tool-call parsing, streaming helper.

Source of the format: ``/work/shared/docs/MODEL_FACTS.md`` section 1 and the published MiniMax-M2
chat template (used only as a test oracle, see tests/fixtures/chat/README.md).
"""

from minimax_jax.chat.errors import ChatFormatError
from minimax_jax.chat.io import ChatRequest, load_chat_file
from minimax_jax.chat.streaming import ends_inside_tool_call, tool_call_state
from minimax_jax.chat.template import render_chat
from minimax_jax.chat.tool_args import ArgumentTypeError, convert_argument
from minimax_jax.chat.tool_calls import (ParsedOutput, ToolCall, ToolCallError,
                                         parse_model_output, parse_tool_calls, split_reasoning)

__all__ = ["ArgumentTypeError", "ChatFormatError", "ChatRequest", "ParsedOutput", "ToolCall",
           "ToolCallError", "convert_argument", "ends_inside_tool_call", "load_chat_file",
           "parse_model_output", "parse_tool_calls", "render_chat", "split_reasoning",
           "tool_call_state"]
