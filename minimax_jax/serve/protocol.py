"""OpenAI-style request models (pydantic) and errors for the server.

Requests follow the OpenAI completions / chat completions APIs. Sampling adjustments, per choice
(``minimax_jax.infer.penalties``, applied to the raw logits before temperature and filters):
``presence_penalty`` / ``frequency_penalty`` in [-2, 2] over the tokens generated so far by that choice,
``logit_bias`` ``{"<token id>": bias in [-100, 100]}`` (``repetition_penalty`` > 0 over prompt +
generated tokens is an extension, as vLLM's). Reported log-probabilities are the model's own (before
these adjustments). ``echo`` (completions) prepends the prompt text to each choice's text; echo with
``logprobs`` is refused with 400 (prompt log-probabilities would need the logits of every prompt
position, which the chunked prefill does not produce). Fields we do not implement (``best_of`` > n,
``suffix``) are refused with 400 rather than ignored. ``top_k`` (0 or -1 = off), ``min_p`` and
``ignore_eos`` (keep generating past stop tokens up to ``max_tokens``, as vLLM's; for load tests) are
extensions (pass them in ``extra_body`` with the ``openai`` client). Errors are
``{"error": {"message", "type", "param", "code"}}`` (``ApiError.body``).

Unknown fields (a misspelt ``temprature``, another server's extension) are refused with 400 naming them
(code ``unknown_parameter``, with the nearest known name), not ignored. Accepted and ignored: ``user``, and
on chat completions the OpenAI fields that change no output of this server (``IGNORED_FIELDS``: ``metadata``,
``store``, ``service_tier``, ``parallel_tool_calls``, ``prompt_cache_key``, ``safety_identifier``).
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["ApiError", "ChatCompletionRequest", "CompletionRequest", "IGNORED_FIELDS", "MAX_LOGIT_BIAS", "MAX_N",
           "MAX_STOP", "MAX_TOP_LOGPROBS", "StreamOptions"]

MAX_N = 16
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
#: Fields of OpenAI's chat API accepted and ignored (bookkeeping and routing: no effect on what this server
#: generates).
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                            "safety_identifier"})


class ApiError(Exception):
    """An error answered as OpenAI-style JSON with HTTP ``status``."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
             500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints (sampling, stops, counts)."""

    # allow_inf_nan=False: NaN / inf numbers are refused as "not finite", not compared with the bounds
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    #: OpenAI fields accepted and ignored by this endpoint (``unsupported`` refuses any other unknown field).
    ignored_fields: ClassVar[frozenset] = frozenset()

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2 ** 31 - 1)           # int32 in the sampler
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    seed: Optional[int] = Field(None, ge=0, le=2 ** 63 - 1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: Optional[dict[str, Any]] = None
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for key, b in (v or {}).items():
            if not key.isdigit() or not key.isascii():
                raise ValueError(f"logit_bias key {key!r} is not a token id (a non-negative integer string)")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{key!r}] = {b!r} is not a number in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}]")
        return v

    def unsupported(self) -> None:
        """Raise ApiError(400) for unknown fields (module docstring) and accepted-but-unimplemented fields set to
        non-defaults."""
        unknown = sorted(set(self.model_extra or {}) - self.ignored_fields)
        if unknown:
            known = sorted(set(type(self).model_fields) | self.ignored_fields)

            def name(f: str) -> str:
                near = difflib.get_close_matches(f, known, n=1)
                return repr(f) + (f" (did you mean {near[0]!r}?)" if near else "")
            raise ApiError(400, f"unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: "
                                f"{', '.join(map(name, unknown))}; this endpoint takes {', '.join(known)}",
                           unknown[0], "unknown_parameter")

    def logit_bias_arrays(self, vocab_size: int) -> tuple[list[int], list[float]] | None:
        """``logit_bias`` as (token ids, biases), None when empty. Raises ApiError(400) naming a key
        outside ``[0, vocab_size)``."""
        if not self.logit_bias:
            return None
        ids = [int(k) for k in self.logit_bias]
        for k, t in zip(self.logit_bias, ids):
            if t >= vocab_size:
                raise ApiError(400, f"logit_bias key {k!r} is not a token id of this model ([0, {vocab_size}))",
                               "logit_bias", "invalid_value")
        return ids, [float(b) for b in self.logit_bias.values()]

    @property
    def top_k_value(self) -> int:
        return max(self.top_k, 0)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string, a list of one string, or token ids."""

    prompt: Union[str, list[str], list[int]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo and self.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported by this server (no prompt log-probabilities); "
                                "drop one of them", "echo", "unsupported_parameter")
        if self.suffix:
            raise ApiError(400, "suffix is not supported by this server", "suffix", "unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of other than n is not supported", "best_of", "unsupported_parameter")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ApiError(400, "send one prompt per request (a list of several prompts is not supported)",
                           "prompt", "unsupported_parameter")


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: messages (system/user/assistant/tool) and optional tools."""

    ignored_fields: ClassVar[frozenset] = IGNORED_FIELDS

    messages: list[dict[str, Any]]
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict]] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: Optional[int] = Field(None, ge=1)

    def unsupported(self) -> None:
        super().unsupported()
        if not self.messages:
            raise ApiError(400, "messages is empty: send at least one message", "messages", "invalid_value")
        if self.tool_choice not in (None, "auto", "none"):
            raise ApiError(400, "tool_choice other than 'auto' / 'none' is not supported", "tool_choice",
                           "unsupported_parameter")
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs", "invalid_value")
