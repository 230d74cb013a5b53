"""Load benchmark of the OpenAI-compatible server (issue 28): a stream of streamed completions with a
realistic mix at rising Poisson arrival rates, through the async ``openai`` client.

The mix: prompt lengths log-uniform in ``--prompt_len LO,HI`` tokens, output lengths uniform in
``--output_len LO,HI`` (``ignore_eos``: every request generates its full length); a fraction
``--shared`` of the requests start with one of ``--prefixes`` shared prefixes covering
``--prefix_frac`` of the prompt (the agent case: one long system prompt + history; the server's
prefix cache should serve those pages). Prompts are random token ids sent as ids.

Per request: time to first token (TTFT), mean inter-token latency (ITL, between streamed chunks),
end-to-end latency, output tokens (the usage chunk). Per rate: throughput (finished requests/s,
output tokens/s over the rate's wall time), p50 / p99 of TTFT / ITL / end-to-end, prefix-cache hit
rate over the rate (``/metrics``: cached / prompt tokens admitted), errors, 429s apart.

Usage (GPU machine, in-process server on a free port, MSA vs dense on the same model):
  PYTHONUNBUFFERED=1 python3 bench/serve_load.py --checkpoint CKPT --attention as_trained --out $OUT
  PYTHONUNBUFFERED=1 python3 bench/serve_load.py --checkpoint CKPT --attention dense --out $OUT
Against a running server:  python bench/serve_load.py --url http://HOST:8000 --out /tmp/sl
CPU smoke run (shipped demo model, a few seconds):  python bench/serve_load.py --tiny --out /tmp/sl
Writes serve_load_<attention>.json under --out; prints a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

TINY = dict(prompt_len="64,200", output_len="4,12", rates="4,16", requests=8, max_batch=4, max_len=256,
            prefill_chunk=64, prefixes=2)


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want LO,HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="Base URL of a running server (default: start one in-process).")
    p.add_argument("--checkpoint", default=None, help="In-process server: checkpoint (default: the shipped demo).")
    p.add_argument("--attention", choices=("as_trained", "dense"), default="as_trained",
                   help="In-process server: load_model(attention=...); with --url only a label.")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    p.add_argument("--tiny", action="store_true", help="CPU preset: " + ", ".join(f"{k}={v}" for k, v in TINY.items()))
    p.add_argument("--rates", default="0.25,0.5,1,2", help="Arrival rates, requests/s, comma-separated.")
    p.add_argument("--requests", type=int, default=64, help="Requests per rate.")
    p.add_argument("--prompt_len", default="1024,131072", help="LO,HI prompt tokens (log-uniform).")
    p.add_argument("--output_len", default="256,2048", help="LO,HI output tokens (uniform).")
    p.add_argument("--shared", type=float, default=0.5, help="Fraction of requests with a shared prefix.")
    p.add_argument("--prefixes", type=int, default=4, help="Distinct shared prefixes.")
    p.add_argument("--prefix_frac", type=float, default=0.75, help="Shared prefix length / prompt length.")
    p.add_argument("--max_batch", type=int, default=16, help="In-process server: engine slots.")
    p.add_argument("--max_len", type=int, default=None, help="In-process server: default max prompt + output.")
    p.add_argument("--max_queue", type=int, default=256, help="In-process server: waiting sequences before 429.")
    p.add_argument("--prefill_chunk", type=int, default=2048, help="In-process server: prompt tokens per chunk.")
    p.add_argument("--decode_loop", type=int, default=1, help="In-process server: greedy decode steps per device loop "
                   "(multi-step scheduling, serve --decode_loop).")
    p.add_argument("--vocab", type=int, default=None, help="Token ids drawn from [0, vocab) (default: the "
                                                          "in-process model's; 32000 with --url).")
    p.add_argument("--timeout", type=float, default=1800.0, help="Per-request timeout, seconds.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="Directory for the JSON (default: print only).")
    return p


def parse(argv=None):
    p = build_parser()
    if argv is None:
        argv = sys.argv[1:]
    if "--tiny" in argv:
        p.set_defaults(**TINY)
    f = p.parse_args(argv)
    f.prompt_len, f.output_len = _pair(f.prompt_len), _pair(f.output_len)
    f.rates = [float(r) for r in str(f.rates).split(",")]
    if any(r <= 0 for r in f.rates) or f.requests < 1 or not 0 <= f.shared <= 1 or not 0 < f.prefix_frac < 1:
        p.error("rates > 0, requests >= 1, shared in [0, 1], prefix_frac in (0, 1)")
    if f.max_len is None:
        f.max_len = f.prompt_len[1] + f.output_len[1]
    return f


# ----------------------------------------------------------------------------- workload
def workload(f, vocab: int, rng: np.random.Generator, prefixes: list[list[int]]) -> list[dict]:
    """One rate's requests: ``{"prompt": ids, "max_tokens", "at": arrival offset s, "shared": bool}``."""
    lo, hi = f.prompt_len
    reqs, at = [], 0.0
    for _ in range(f.requests):
        n = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        shared = bool(prefixes) and rng.random() < f.shared
        head = []
        if shared:
            pre = prefixes[rng.integers(len(prefixes))]
            head = pre[:max(1, min(len(pre), int(n * f.prefix_frac)))]
        tail = rng.integers(0, vocab, max(1, n - len(head))).tolist()
        reqs.append(dict(prompt=head + tail, max_tokens=int(rng.integers(f.output_len[0], f.output_len[1] + 1)),
                         at=at, shared=shared))
        at += rng.exponential(1.0)      # scaled by 1 / rate in run_rate
    return reqs


async def one(client, model: str, r: dict, t_start: float, rate: float, timeout: float) -> dict:
    import openai

    await asyncio.sleep(max(0.0, t_start + r["at"] / rate - time.perf_counter()))
    t0 = time.perf_counter()
    rec = dict(prompt_tokens=len(r["prompt"]), max_tokens=r["max_tokens"], shared=r["shared"], status="ok",
               ttft_s=None, itl_s=None, e2e_s=None, output_tokens=0)
    stamps = []
    try:
        stream = await client.completions.create(
            model=model, prompt=r["prompt"], max_tokens=r["max_tokens"], temperature=r.get("temperature", 0),
            stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=timeout)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter())
            if getattr(chunk, "usage", None) is not None:
                rec["output_tokens"] = chunk.usage.completion_tokens
                rec["cached_tokens"] = getattr(getattr(chunk.usage, "prompt_tokens_details", None),
                                               "cached_tokens", None)
    except openai.RateLimitError as e:
        rec.update(status="429", error=str(e)[:200])
    except Exception as e:     # noqa: BLE001 - every failure is a data point
        rec.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
    t1 = time.perf_counter()
    if rec["status"] == "ok":
        rec["e2e_s"] = t1 - t0
        if stamps:
            rec["ttft_s"] = stamps[0] - t0
            if len(stamps) > 1:
                rec["itl_s"] = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    rec["start_s"], rec["end_s"] = t0 - t_start, t1 - t_start
    return rec


def scrape(base: str) -> dict:
    """The server's counters (``/metrics``), name -> value (labelled series summed)."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(?:\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _pct(xs, q):
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


def summarize(rate: float, recs: list[dict], before: dict, after: dict) -> dict:
    ok = [r for r in recs if r["status"] == "ok"]
    wall = max((r["end_s"] for r in recs), default=0.0) or 1e-9
    toks = sum(r["output_tokens"] for r in ok)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0)
         for k in ("minimax_serve_prompt_tokens_total", "minimax_serve_cached_prompt_tokens_total")}
    prompt = d["minimax_serve_prompt_tokens_total"]
    row = dict(rate=rate, requests=len(recs), ok=len(ok), rejected_429=sum(r["status"] == "429" for r in recs),
               errors=sum(r["status"] == "error" for r in recs), wall_s=wall, requests_per_s=len(ok) / wall,
               output_tokens_per_s=toks / wall, output_tokens=toks,
               prefix_cache_hit_rate=d["minimax_serve_cached_prompt_tokens_total"] / prompt if prompt else 0.0)
    for key in ("ttft_s", "itl_s", "e2e_s"):
        vals = [r[key] for r in ok]
        row[key.replace("_s", "_p50_s")], row[key.replace("_s", "_p99_s")] = _pct(vals, 50), _pct(vals, 99)
    return row


async def run_rates(f, base: str, model: str, vocab: int) -> list[dict]:
    import openai

    rng = np.random.default_rng(f.seed)
    plen = int(f.prompt_len[1] * f.prefix_frac)
    prefixes = [rng.integers(0, vocab, plen).tolist() for _ in range(f.prefixes)] if f.shared > 0 else []
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=f.timeout)
    # one longest-prompt request first: compiles the engine's steps (every prefill table width) outside
    # the timed rates
    warm = dict(prompt=rng.integers(0, vocab, f.prompt_len[1]).tolist(), max_tokens=2, at=0.0, shared=False)
    w = await one(client, model, warm, time.perf_counter(), 1.0, f.timeout)
    if w["status"] != "ok":
        raise RuntimeError(f"warm-up request failed: {w.get('error')}")
    # and one sampled request (temperature 1: never in a device loop), so that a server with --decode_loop > 1
    # has compiled its one-step decode too (the greedy warm-up decodes in a loop; the one-step path then compiled
    # on its first use inside the first timed rate, seen with JAX_LOG_COMPILES=1)
    warm = dict(prompt=np.random.default_rng(f.seed + 1).integers(0, vocab, 16).tolist(), max_tokens=3, at=0.0,
                shared=False, temperature=1.0)        # its own generator: the timed workloads stay as before
    w = await one(client, model, warm, time.perf_counter(), 1.0, f.timeout)
    if w["status"] != "ok":
        raise RuntimeError(f"sampled warm-up request failed: {w.get('error')}")
    rows = []
    try:
        for rate in f.rates:
            reqs = workload(f, vocab, rng, prefixes)
            before = await asyncio.to_thread(scrape, base)
            t_start = time.perf_counter()
            recs = await asyncio.gather(*(one(client, model, r, t_start, rate, f.timeout) for r in reqs))
            after = await asyncio.to_thread(scrape, base)
            row = summarize(rate, list(recs), before, after)
            row["per_request"] = list(recs)
            rows.append(row)
            print(f"rate {rate:g}/s: {row['ok']}/{row['requests']} ok, {row['output_tokens_per_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
    finally:
        await client.close()
    return rows


@contextlib.contextmanager
def server(f):
    """(base URL, model id, vocab) of the server under test: ``--url`` or one started in-process."""
    if f.url:
        base = f.url.rstrip("/")
        if base.endswith("/v1"):
            base = base[:-3]
        models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=30))
        yield base, models["data"][0]["id"], f.vocab or 32000
        return
    from minimax_jax.infer.loading import load_model
    from minimax_jax.serve.server import build, in_thread

    model = load_model(f.checkpoint, dtype=f.dtype, attention=f.attention, log=lambda m: print(m, file=sys.stderr))
    srv = build(model, max_batch=f.max_batch, max_len=f.max_len, max_queue=f.max_queue,
                prefill_chunk=f.prefill_chunk, decode_loop=f.decode_loop)
    try:
        with in_thread(srv.app) as port:
            yield f"http://127.0.0.1:{port}", srv.model_name, f.vocab or model.cfg.vocab_size
    finally:
        srv.close()


def table(rows: list[dict]) -> str:
    def ms(v):
        return "-" if v is None else f"{1e3 * v:.0f}"

    head = (f"{'rate/s':>7} {'ok':>5} {'429':>4} {'err':>4} {'req/s':>7} {'tok/s':>8} {'TTFT p50/p99 ms':>17} "
            f"{'ITL p50/p99 ms':>16} {'E2E p50/p99 ms':>17} {'hit':>5}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['rate']:>7g} {r['ok']:>5} {r['rejected_429']:>4} {r['errors']:>4} {r['requests_per_s']:>7.2f} "
                     f"{r['output_tokens_per_s']:>8.1f} {ms(r['ttft_p50_s']) + '/' + ms(r['ttft_p99_s']):>17} "
                     f"{ms(r['itl_p50_s']) + '/' + ms(r['itl_p99_s']):>16} "
                     f"{ms(r['e2e_p50_s']) + '/' + ms(r['e2e_p99_s']):>17} {r['prefix_cache_hit_rate']:>5.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    f = parse(argv)
    with server(f) as (base, model, vocab):
        rows = asyncio.run(run_rates(f, base, model, vocab))
    result = dict(bench="serve_load", attention=f.attention, url=f.url, checkpoint=f.checkpoint, model=model,
                  config={k: v for k, v in vars(f).items() if k not in ("out",)}, rates=rows)
    if f.out:
        os.makedirs(f.out, exist_ok=True)
        path = os.path.join(f.out, f"serve_load_{f.attention}.json")
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {path}", file=sys.stderr)
    print(table(rows), flush=True)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
