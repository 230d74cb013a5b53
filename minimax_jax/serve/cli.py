"""Command line of the OpenAI-compatible server: ``python -m minimax_jax.serve`` (flags: ``--help``);
``main(argv)`` is the entry point for other launchers (``python infer.py serve ...`` passes the rest).

With no ``--checkpoint`` it serves the shipped demo checkpoint (as ``infer.py``). Exit status as the
other tools (``minimax_jax.cli_main``): 2 for bad flags / checkpoints (a ``--max_len`` past the model's context,
an engine whose KV cache would not fit in the memory left: checked before it is allocated), 1 for runtime
failures.
"""

from __future__ import annotations

import sys

from minimax_jax import cli_main
from minimax_jax.exit_codes import UsageError

PROG = "python -m minimax_jax.serve"


def build_parser(prog: str = PROG):
    p = cli_main.Parser(prog=prog, description="Serve a MiniMax-M2 / M3 checkpoint over the OpenAI API "
                                               "(continuous batching on the paged engine).")
    p.add_argument("--checkpoint", default=None, help="Checkpoint directory (ours or Hugging Face); default: the "
                                                      "shipped demo checkpoint checkpoints/demo/.")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one in --checkpoint).")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (default %(default)s).")
    p.add_argument("--port", type=cli_main.int_at_least(0, 65535), default=8000, help="TCP port (default %(default)s).")
    p.add_argument("--max_batch", type=cli_main.int_at_least(1), default=8, help="Sequences decoded together "
                                                                                 "(engine slots; default %(default)s).")
    p.add_argument("--max_len", type=cli_main.int_at_least(2), default=4096, help="Longest prompt + completion "
                                                                                  "in tokens (rounded up to a "
                                                                                  "power of two; default "
                                                                                  "%(default)s).")
    p.add_argument("--max_queue", type=cli_main.int_at_least(1), default=64, help="Waiting sequences before "
                                                                                  "requests get 429 (default "
                                                                                  "%(default)s).")
    p.add_argument("--prefill_chunk", type=cli_main.int_at_least(1), default=256, help="Prompt tokens per "
                                                                                       "prefill step (default "
                                                                                       "%(default)s).")
    p.add_argument("--token_budget", type=cli_main.int_at_least(1), default=None,
                   help="Tokens per scheduler iteration (one per decoding sequence + prefill tokens); default: one "
                        "prefill chunk per prefilling sequence on top of the decode tokens.")
    p.add_argument("--default_max_tokens", type=cli_main.int_at_least(1), default=256,
                   help="Chat completion length when the request gives no max_tokens (default %(default)s).")
    p.add_argument("--served_model_name", default=None, help="Model id of the API (default: the checkpoint "
                                                             "folder's name).")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="Cast the parameters on load.")
    p.add_argument("--attention", choices=("as_trained", "dense"), default="as_trained",
                   help="as_trained, or dense: run MSA layers as full attention (as infer.py --attention).")
    p.add_argument("--speculative", choices=("none", "mtp"), default="none",
                   help="Speculative decoding: 'mtp' drafts with the model's MTP modules and verifies the drafts in "
                        "the batched decode step (greedy output identical; as infer.py --speculative).")
    p.add_argument("--num_draft", type=cli_main.int_at_least(1), default=None,
                   help="Drafts per step with --speculative mtp (default: all MTP modules).")
    p.add_argument("--mtp_window", type=cli_main.int_at_least(1, 8192), default=None,
                   help="Positions the MTP layers attend over while drafting with --speculative mtp (default 64, "
                        "at most 8192: infer.drafter.MAX_MTP_WINDOW).")
    p.add_argument("--decode_loop", type=cli_main.int_at_least(1), default=1,
                   help="Multi-step scheduling: while nobody waits or is prefilled and every decoding request is "
                        "greedy (no penalties, logit bias or logprobs), run this many decode steps in one compiled "
                        "device loop (one host round trip per N steps; the same tokens; with --speculative mtp, N "
                        "speculative steps drafted, verified and accepted on the device); 1 = one step per "
                        "iteration.")
    cli_main.add_bool(p, "prefix_cache", True, "Share cached prompt pages across requests.")
    cli_main.add_bool(p, "warmup", False, "Before listening, compile the engine's steps with a few internal requests "
                      "(the prefill step at every page-table width, the decode loop, the one-step decode), so that "
                      "the first requests pay no compile time (startup takes longer).")
    cli_main.add_mesh(p)
    return cli_main.add_common(p, cache=True)


def _main(argv, prog: str = PROG) -> int:
    import uvicorn

    from minimax_jax.infer.loading import load_model
    from minimax_jax.serve.server import build, uvicorn_config

    parser = build_parser(prog)
    flags = cli_main.parse_args(parser, argv)
    for flag in ("num_draft", "mtp_window"):
        if getattr(flags, flag) is not None and flags.speculative == "none":
            parser.error(f"--{flag} needs --speculative mtp")
    if flags.sharding_rules is not None and not flags.mesh:
        parser.error("--sharding_rules applies only with --mesh")
    from minimax_jax.decode import mesh_attention
    from minimax_jax.sharding import load_rules

    n = mesh_attention.sequence_devices(flags.mesh, load_rules(flags.sharding_rules or "default"))
    try:
        mesh_attention.prefill_chunk(n, flags.prefill_chunk, explicit=True)
    except ValueError as e:
        parser.error(str(e))
    if why := _address_problem(flags.host, flags.port):    # before the model loads (minutes for a large one)
        raise UsageError(why)
    from minimax_jax.infer.loading import peek_config, resolve_checkpoint

    cfg = peek_config(resolve_checkpoint(flags.checkpoint))     # likewise: the config's limits, before loading
    if flags.max_len > cfg.max_position_embeddings:
        raise UsageError(f"--max_len {flags.max_len} is longer than the model's context of "
                         f"{cfg.max_position_embeddings} tokens (max_position_embeddings); give at most that")
    if flags.num_draft is not None:                          # the config says how many drafts there can be
        have = min(cfg.num_mtp_modules, 15)
        if flags.num_draft > have:
            raise UsageError(f"--num_draft {flags.num_draft}: this model has {have} MTP modules, so at most {have} "
                             "drafts per step")
    cli_main.enable_compilation_cache(flags.compilation_cache, prog=prog)
    log = lambda m: print(m, file=sys.stderr, flush=True)            # noqa: E731
    model = load_model(flags.checkpoint, tokenizer_path=flags.tokenizer, dtype=flags.dtype,
                       attention=flags.attention, log=log, mesh=flags.mesh, rules=flags.sharding_rules or "default")
    if model.mesh is not None:
        log("mesh " + ",".join(f"{k}={v}" for k, v in model.mesh.shape.items() if v > 1)
            + (f"; prefill: context parallel over sequence={n}" if n > 1 else ""))
        if line := mesh_attention.describe_cache(model.cfg, model.mesh, model.rules):
            log(line)
    if flags.warmup:
        log("warming up: compiling the engine's steps before listening")
    from minimax_jax.decode.engine import CacheTooLarge

    try:
        server = build(model, max_batch=flags.max_batch, max_len=flags.max_len, max_queue=flags.max_queue,
                       prefill_chunk=flags.prefill_chunk, model_name=flags.served_model_name,
                       default_max_tokens=flags.default_max_tokens, prefix_cache=flags.prefix_cache,
                       token_budget=flags.token_budget, num_draft=flags.num_draft,
                       mtp_window=64 if flags.mtp_window is None else flags.mtp_window,
                       speculative=None if flags.speculative == "none" else flags.speculative,
                       decode_loop=flags.decode_loop, warmup=flags.warmup)
    except CacheTooLarge as e:       # checked before the engine allocates its cache
        raise UsageError(f"{e}; lower --max_len or --max_batch") from None
    print(f"serving {server.model_name} on http://{flags.host}:{flags.port}/v1 ({server.scheduler.max_batch} "
          f"slots, max_len {server.scheduler.max_len})", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn_config(server.app, host=flags.host, port=flags.port)).run()
    except SystemExit as e:       # uvicorn exits 3 when it cannot start (its own error line is printed above)
        if e.code not in (0, None):
            print(f"{prog}: error: the server could not start on {flags.host}:{flags.port} (uvicorn's message above)",
                  file=sys.stderr, flush=True)
            return 1
        raise
    finally:
        server.close()
    return 0


def _address_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port`` (unknown host, port in use, no permission), found by
    binding a socket there now and closing it (as uvicorn binds: SO_REUSEADDR), or None."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        return f"--host {host!r}: {getattr(e, 'strerror', None) or e}"
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror}"
    return None


def main(argv=None, prog: str = PROG) -> int:
    """Run the server CLI; ``prog`` names the tool in messages (``infer.py serve`` passes its own name)."""
    import functools

    from minimax_jax.config import ConfigError
    from minimax_jax.convert.errors import CheckpointError
    from minimax_jax.infer.errors import CheckpointNotFound, InferenceError, TokenizerNotFound

    return cli_main.run(functools.partial(_main, prog=prog), argv, prog=prog, usage=(ValueError, CheckpointNotFound, TokenizerNotFound),
                        failure=(InferenceError, ConfigError, CheckpointError))
