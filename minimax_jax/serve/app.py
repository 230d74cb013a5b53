"""FastAPI routes of the OpenAI-compatible server.

``/v1/completions``, ``/v1/chat/completions`` (MiniMax chat template, ``minimax_jax.chat``),
``/v1/models``, ``/health``, ``/metrics``. Requests become ``Sequence``s (one per choice ``n``) on the
``Scheduler``; its worker thread's events are bridged to one asyncio queue per HTTP request.
Streaming is server-sent events (``data: {json}`` lines, then ``data: [DONE]``). A streaming client
that disconnects cancels its sequences (the worker frees their slots and pages). Status codes: 400
bad parameters / prompt too long for the engine, 404 unknown model or path, 429 queue full, 500
engine failure, 503 worker not running.
"""

from __future__ import annotations

import asyncio
import json
import random

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minimax_jax.chat import ChatFormatError, render_chat
from minimax_jax.infer.sampler import SamplingParams
from minimax_jax.serve import responses as R
from minimax_jax.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from minimax_jax.serve.scheduler import QueueFull, Scheduler, Sequence

__all__ = ["build_app"]


def build_app(scheduler: Scheduler, tokenizer, model_name: str, *, metrics, default_max_tokens: int = 256) -> FastAPI:
    """The app over a started ``scheduler``; ``model_name`` is the one id ``/v1/models`` lists."""
    app = FastAPI(title="minimax-jax", docs_url=None, redoc_url=None)
    created = R.now()
    vocab = scheduler.gen.cfg.vocab_size

    def piece(i: int) -> str:
        return tokenizer.decode([int(i)], skip_special_tokens=False)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def _api_error(_request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        body_level = tuple(first.get("loc", ())) == ("body",)
        ctype = request.headers.get("content-type", "")
        if body_level and first.get("type") == "missing":
            return JSONResponse(ApiError(400, "the request body is empty: expected a JSON object", None,
                                         "invalid_json").body(), status_code=400)
        if body_level and first.get("type") == "model_attributes_type" and "json" not in ctype.lower():
            return JSONResponse(ApiError(400, f"Content-Type must be application/json (got {ctype or 'none'!r})",
                                         None, "invalid_value").body(), status_code=400)
        if first.get("type") == "json_invalid":        # loc = ("body", character offset)
            at = first.get("loc", ("body", "?"))[-1]
            why = (first.get("ctx") or {}).get("error", "not JSON")
            return JSONResponse(ApiError(400, f"the request body is not valid JSON: {why} at character {at}", None,
                                         "invalid_json").body(), status_code=400)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if not loc and first.get("type") == "model_attributes_type":
            return JSONResponse(ApiError(400, "the request body must be a JSON object", None, "invalid_value").body(),
                                status_code=400)
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body')}: {er.get('msg')}"
                        for er in errs) or "invalid request"
        return JSONResponse(ApiError(400, msg, loc[0] if loc else None, "invalid_value").body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, e: StarletteHTTPException):
        if e.status_code == 400 and str(e.detail) == "There was an error parsing the body":   # FastAPI's words
            return JSONResponse(ApiError(400, "the request body is not valid JSON (it could not be parsed: not UTF-8 "
                                              "or nested too deeply)", None, "invalid_json").body(), status_code=400)
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    # ------------------------------------------------------------------ plain routes
    @app.get("/health")
    async def health():
        if not scheduler.alive:
            raise ApiError(503, f"engine worker is not running ({scheduler.error!r})")
        return {"status": "ok", "queue": scheduler.queue_length, "active": scheduler.active_count,
                "free_slots": scheduler.free_slots()}

    @app.get("/metrics")
    async def metrics_route():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "minimax-jax", "max_model_len": scheduler.max_len}]}

    # ------------------------------------------------------------------ generation
    def check(req, param: str, prompt: list[int], max_tokens: int | None) -> int:
        if req.model != model_name:
            raise ApiError(404, f"The model `{req.model}` does not exist; this server serves `{model_name}`",
                           "model", "model_not_found")
        req.unsupported()
        if not prompt:
            raise ApiError(400, "the prompt is empty (it encodes to no tokens)", param, "invalid_value")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids outside [0, {vocab}): {bad[:5]}", param, "invalid_value")
        room = scheduler.max_len - len(prompt)
        if max_tokens is None:
            max_tokens = min(default_max_tokens, room)
        if max_tokens < 1 or len(prompt) + max_tokens > scheduler.max_len:
            raise ApiError(400, f"This model's maximum context length is {scheduler.max_len} tokens. However, you "
                                f"requested {len(prompt) + max(max_tokens, 1)} tokens ({len(prompt)} in the prompt, "
                                f"{max(max_tokens, 1)} for the completion). Shorten the prompt or lower max_tokens.",
                           param, "context_length_exceeded")
        return max_tokens

    def sampling(req) -> SamplingParams:
        seed = req.seed if req.seed is not None else random.randrange(1 << 31)
        try:
            return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k_value,
                                  min_p=req.min_p, seed=seed, presence_penalty=req.presence_penalty,
                                  frequency_penalty=req.frequency_penalty,
                                  repetition_penalty=req.repetition_penalty)
        except ValueError as e:
            raise ApiError(400, str(e), None, "invalid_value") from None

    def start(req, prompt, max_tokens, logprobs):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(i):
            def emit(ev):
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, (i, ev))
                except RuntimeError:     # the event loop is gone (shutdown)
                    pass
            return emit

        params, bias = sampling(req), req.logit_bias_arrays(vocab)
        seqs = [Sequence(prompt, max_tokens, params, sink(j), row_id=j, stop_strings=tuple(req.stop or ()),
                         logprobs=logprobs, ignore_eos=req.ignore_eos, logit_bias=bias) for j in range(req.n)]
        if not scheduler.alive:
            raise ApiError(503, "engine worker is not running")
        try:
            scheduler.submit(seqs)
        except QueueFull as e:
            metrics.reject()
            raise ApiError(429, str(e), None, "queue_full") from None
        return seqs, queue

    async def collect(seqs, queue, request: Request) -> tuple[list[dict], list[list[dict]]]:
        """Every sequence's events until done; a client gone meanwhile cancels them (checked each second)."""
        done: list = [None] * len(seqs)
        entries: list[list[dict]] = [[] for _ in seqs]
        loop_time = asyncio.get_running_loop().time
        last = loop_time()
        try:
            while any(d is None for d in done):
                if loop_time() - last > 1.0:
                    last = loop_time()
                    if await request.is_disconnected():
                        raise ApiError(499, "client disconnected")
                try:
                    i, ev = await asyncio.wait_for(queue.get(), 1.0)
                except asyncio.TimeoutError:
                    continue
                if ev["type"] == "error":
                    raise ApiError(500, ev["message"], None, "engine_error")
                if ev["type"] == "token":
                    entries[i] += ev["logprobs"]
                else:
                    done[i] = ev
        finally:
            for s, d in zip(seqs, done):
                if d is None:
                    s.cancel()
        return done, entries

    async def events(seqs, queue):
        """(index, event) until every sequence is done; cancels the rest when the consumer stops."""
        left = len(seqs)
        try:
            while left:
                i, ev = await queue.get()
                if ev["type"] == "error":
                    yield i, ev
                    return
                if ev["type"] == "done":
                    left -= 1
                yield i, ev
        finally:
            for s in seqs:
                s.cancel()

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def stream_error(ev) -> str:
        return sse(ApiError(500, ev["message"], None, "engine_error").body())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            p = p[0]
        prompt = tokenizer.encode(p, add_special_tokens=False).ids if isinstance(p, str) else [int(t) for t in p]
        max_tokens = check(req, "prompt", prompt, req.max_tokens)
        seqs, queue = start(req, prompt, max_tokens, req.logprobs)
        cid, now = R.new_id("cmpl"), R.now()
        echo = "" if not req.echo else p if isinstance(p, str) else tokenizer.decode(prompt, skip_special_tokens=False)
        if not req.stream:
            done, entries = await collect(seqs, queue, request)
            choices = [{"index": j, "text": echo + d["text"], "finish_reason": d["finish_reason"],
                        "logprobs": None if req.logprobs is None else R.completion_logprobs(entries[j], piece)}
                       for j, d in enumerate(done)]
            return {"id": cid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": choices, "usage": R.usage(len(prompt), done)}

        async def body():
            done, offsets = [], [0] * len(seqs)
            for j in range(len(seqs) if echo else 0):
                yield sse({"id": cid, "object": "text_completion", "created": now, "model": model_name,
                           "choices": [{"index": j, "text": echo, "finish_reason": None, "logprobs": None}]})
            async for i, ev in events(seqs, queue):
                if ev["type"] == "error":
                    yield stream_error(ev)
                    break
                if ev["type"] == "token":
                    text, lps = ev["text"], None
                    if req.logprobs is not None:
                        lps = R.completion_logprobs(ev["logprobs"], piece, offsets[i])
                    offsets[i] += len(text)
                    choice = {"index": i, "text": text, "finish_reason": None, "logprobs": lps}
                else:
                    done.append(ev)
                    choice = {"index": i, "text": "", "finish_reason": ev["finish_reason"], "logprobs": None}
                yield sse({"id": cid, "object": "text_completion", "created": now, "model": model_name,
                           "choices": [choice]})
            if req.include_usage and len(done) == len(seqs):
                yield sse({"id": cid, "object": "text_completion", "created": now, "model": model_name,
                           "choices": [], "usage": R.usage(len(prompt), done)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        try:
            text = render_chat(req.messages, req.tools)
        except ChatFormatError as e:
            raise ApiError(400, str(e), "messages", "invalid_value") from None
        prompt = tokenizer.encode(text, add_special_tokens=False).ids
        max_tokens = check(req, "messages", prompt, req.max_completion_tokens or req.max_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        seqs, queue = start(req, prompt, max_tokens, logprobs)
        cid, now = R.new_id("chatcmpl"), R.now()
        if not req.stream:
            done, entries = await collect(seqs, queue, request)
            choices = []
            for j, d in enumerate(done):
                msg, calls = R.chat_message(d["text"], req.tools)
                choices.append({"index": j, "message": msg, "finish_reason": "tool_calls" if calls else d["finish_reason"],
                                "logprobs": R.chat_logprobs(entries[j], piece) if req.logprobs else None})
            return {"id": cid, "object": "chat.completion", "created": now, "model": model_name,
                    "choices": choices, "usage": R.usage(len(prompt), done)}

        async def body():
            deltas = [R.ChatDeltas() for _ in seqs]
            texts, done = [""] * len(seqs), []
            for j in range(len(seqs)):
                yield sse(R.chat_chunk(cid, now, model_name, j, {"role": "assistant", "content": ""}))
            async for i, ev in events(seqs, queue):
                if ev["type"] == "error":
                    yield stream_error(ev)
                    break
                if ev["type"] == "token":
                    texts[i] += ev["text"]
                    delta = deltas[i].update(texts[i])
                    lps = R.chat_logprobs(ev["logprobs"], piece) if req.logprobs else None
                    if delta or lps:
                        yield sse(R.chat_chunk(cid, now, model_name, i, delta, logprobs=lps))
                    continue
                done.append(ev)
                msg, calls = R.chat_message(ev["text"], req.tools)
                last = deltas[i].finish(msg)
                if calls:
                    last["tool_calls"] = [dict(c, index=k) for k, c in enumerate(msg["tool_calls"])]
                reason = "tool_calls" if calls else ev["finish_reason"]
                yield sse(R.chat_chunk(cid, now, model_name, i, last, finish_reason=reason))
            if req.include_usage and len(done) == len(seqs):
                yield sse({"id": cid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                           "choices": [], "usage": R.usage(len(prompt), done)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return app
