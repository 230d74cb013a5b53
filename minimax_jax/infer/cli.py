"""Command line for ``python infer.py`` (flags below; ``--help`` explains each).

Output: the generated text on stdout (as it is generated with ``--stream``); for ``--chat_file`` the
parsed turn (reasoning, content, tool calls, malformed-tool-call errors) follows as JSON after a
``--- parsed output (JSON) ---`` line. Loading messages, the engine that ran, a prefill progress
bar and the statistics (TTFT, tokens/s, acceptance rate) go to stderr. Errors print one
``error: ...`` message and exit with status 1.
"""

from __future__ import annotations

import sys

from absl import flags

FLAGS = flags.FLAGS

flags.DEFINE_string("checkpoint", None, "Checkpoint directory: a converted minimax-jax checkpoint (config.yaml + "
                    "params/) or a Hugging Face directory (config.json + *.safetensors, converted on the fly). "
                    "Default: the shipped demo checkpoint checkpoints/demo/.")
flags.DEFINE_string("tokenizer", None, "tokenizer.json (or its directory); default: tokenizer.json in --checkpoint.")
flags.DEFINE_string("prompt", None, "Prompt text, continued as is (no chat template).")
flags.DEFINE_string("prompt_file", None, "File whose text is the prompt (no chat template).")
flags.DEFINE_string("chat_file", None, 'Chat JSON {"messages": [...], "tools": [...]} rendered with the MiniMax '
                    "chat template; the reply is parsed into reasoning, content and tool calls (printed as JSON).")
flags.DEFINE_string("context_file", None, "Long document put before the prompt (with --chat_file: at the start "
                    "of the first user message), for long-context questions.")
flags.DEFINE_integer("max_new_tokens", 256, "Most tokens to generate.", lower_bound=1)
flags.DEFINE_float("temperature", 1.0, "Sampling temperature; 0 = greedy (argmax).", lower_bound=0.0)
flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass in (0, 1] (1 = off).", upper_bound=1.0)
flags.DEFINE_integer("top_k", 40, "Keep the k most likely tokens (0 = off).", lower_bound=0)
flags.DEFINE_float("min_p", 0.0, "Drop tokens below min_p x the top probability (0 = off).", lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "Random seed; the same seed and inputs give the same output.")
flags.DEFINE_multi_string("stop", [], "Stop string (repeatable); the output is cut before it.")
flags.DEFINE_integer("repeat_max_period", 0, "Stop on a repeated token cycle of at most this length "
                     "(with --repeat_max_count; 0 = off).", lower_bound=0)
flags.DEFINE_integer("repeat_max_count", 0, "Stop once such a cycle repeats more than this many times.", lower_bound=0)
flags.DEFINE_boolean("stream", False, "Print text as it is generated.")
flags.DEFINE_enum("speculative", "none", ["none", "mtp"], "Speculative decoding: 'mtp' drafts tokens with the "
                  "model's MTP modules and verifies them in one step (same output distribution; greedy output "
                  "identical); the acceptance rate is reported.")
flags.DEFINE_integer("num_draft", None, "Drafts per step with --speculative mtp (default: all MTP modules).")
flags.DEFINE_integer("mtp_window", 64, "Positions the MTP layers attend over while drafting (each draft step "
                     "runs the MTP layers over this many tokens; larger = better drafts, slower).", lower_bound=1)
flags.DEFINE_enum("engine", "paged", ["paged", "recompute"], "Generation engine: 'paged' = KV-cache decode engine "
                  "(minimax_jax.decode); 'recompute' = full forward each step (slow; for checking).")
flags.DEFINE_integer("prefill_chunk", 0, "Prompt tokens per prefill step of the paged engine; 0 = by prompt length "
                     "(GPU: length // 8 in [256, 16384]; elsewhere 256).", lower_bound=0)
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Parameter and compute dtype: the parameters are cast "
                  "to it on load (default: the checkpoint's own, its config.yaml dtype / param_dtype); also the dtype "
                  "of an on-the-fly Hugging Face conversion (default bfloat16).")
flags.DEFINE_string("mesh", None, "Device mesh, e.g. 'fsdp=2,tensor=2' (axes data, fsdp, expert, sequence, tensor; "
                    "one may be -1); parameters are loaded sharded by --sharding_rules.")
flags.DEFINE_string("sharding_rules", "default", "Sharding rule preset (configs/sharding.yaml) or a YAML path.")
flags.DEFINE_string("convert_dir", None, "Keep the on-the-fly conversion of a Hugging Face checkpoint here "
                    "(reused by later runs) instead of a temporary directory.")
flags.DEFINE_enum("attention", "as_trained", ["as_trained", "dense"], "Attention of the model's MSA layers: "
                  "'as_trained' = as the checkpoint says (MSA top-k block selection); 'dense' = run every MSA layer "
                  "as full causal attention with the same weights (its indexer weights are unused): the dense "
                  "baseline of the same checkpoint. What ran is printed with the statistics.")
flags.DEFINE_boolean("show_stats", True, "Print generation statistics (and the op implementations that ran) "
                     "to stderr.")


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror}") from None


def build_prompt() -> tuple[str, object]:
    """Prompt text and the chat request (None without --chat_file) from the flags.

    Raises: ValueError when zero or several prompt sources are given; ChatFormatError for bad chat files.
    """
    if FLAGS["sharding_rules"].present and not FLAGS.mesh:
        _err("error: --sharding_rules applies only with --mesh (the parameters are sharded by those rules over "
             "that mesh); pass --mesh too, e.g. --mesh fsdp=-1")
        sys.exit(2)
    from minimax_jax.chat import ChatFormatError, ChatRequest, load_chat_file

    given = [n for n in ("prompt", "prompt_file", "chat_file") if getattr(FLAGS, n) is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of --prompt, --prompt_file, --chat_file"
                         + (f" (got {', '.join('--' + g for g in given)})" if given else ""))
    context = _read(FLAGS.context_file, "--context_file") if FLAGS.context_file else None
    if FLAGS.chat_file:
        try:
            req = load_chat_file(FLAGS.chat_file)
        except OSError as e:
            raise ValueError(f"cannot read --chat_file {FLAGS.chat_file!r}: {e.strerror}") from None
        if context is not None:
            msgs = [dict(m) for m in req.messages]
            first = next((m for m in msgs if m.get("role") == "user"), None)
            if first is None or not isinstance(first.get("content"), str):
                raise ChatFormatError(f"{FLAGS.chat_file}: --context_file needs a user message with text content")
            first["content"] = context + "\n\n" + first["content"]
            req = ChatRequest(msgs, req.tools, req.add_generation_prompt)
        return req.render(), req
    text = FLAGS.prompt if FLAGS.prompt is not None else _read(FLAGS.prompt_file, "--prompt_file")
    return (context + "\n\n" + text if context is not None else text), None


def run() -> int:
    """Run the CLI with the parsed flags; returns the exit status."""
    from minimax_jax.infer.generation import GenerationConfig, Generator, check_context
    from minimax_jax.infer.loading import load_model, load_tokenizer_for, peek_config, resolve_checkpoint
    from minimax_jax.infer.sampler import SamplingParams

    prompt_text, chat = build_prompt()
    if FLAGS.num_draft is not None and FLAGS.speculative == "none":
        raise ValueError("--num_draft needs --speculative mtp")
    config = GenerationConfig(
        max_new_tokens=FLAGS.max_new_tokens,
        sampling=SamplingParams(FLAGS.temperature, FLAGS.top_p, FLAGS.top_k, FLAGS.min_p, FLAGS.seed),
        stop_strings=tuple(FLAGS.stop), repeat_max_period=FLAGS.repeat_max_period,
        repeat_max_count=FLAGS.repeat_max_count,
        speculative=None if FLAGS.speculative == "none" else FLAGS.speculative,
        num_draft=FLAGS.num_draft, mtp_window=FLAGS.mtp_window)
    # Cheap checks first (tokenizer, config, context length), then the parameters.
    ckpt = resolve_checkpoint(FLAGS.checkpoint)
    cfg = peek_config(ckpt)
    tokenizer = load_tokenizer_for(ckpt, FLAGS.tokenizer)
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False).ids
    check_context(cfg, [len(prompt)], config.max_new_tokens)
    model = load_model(ckpt, tokenizer_path=FLAGS.tokenizer, dtype=FLAGS.dtype, mesh=FLAGS.mesh,
                       rules=FLAGS.sharding_rules, convert_dir=FLAGS.convert_dir, attention=FLAGS.attention,
                       log=_err)
    where = "single device" if model.mesh is None else "mesh " + ",".join(
        f"{k}={v}" for k, v in model.mesh.shape.items() if v > 1)
    _err(f"model: {model.checkpoint_dir} [{model.source}], {model.cfg.num_layers} layers, "
         f"vocab {model.cfg.vocab_size}, context {model.cfg.max_position_embeddings}, {where}")
    from minimax_jax.infer.backends import auto_prefill_chunk

    chunk = FLAGS.prefill_chunk or auto_prefill_chunk(len(prompt))
    gen = Generator(model.cfg, model.params, model.tokenizer, engine=FLAGS.engine,
                    engine_options={"prefill_chunk": chunk} if FLAGS.engine == "paged" else None,
                    log=_err)
    out = _generate(gen, model, prompt, config, chunk)
    seq = out.sequences[0]
    if not FLAGS.stream:
        sys.stdout.write(seq.text)
    sys.stdout.write("\n")
    if chat is not None:
        from minimax_jax.chat import parse_model_output

        parsed = parse_model_output(seq.text, chat.tools)
        print("--- parsed output (JSON) ---")
        print(parsed.to_json(indent=2))
        for e in parsed.errors:
            _err(f"warning: malformed tool call output ({e.kind}): {e.message}")
    sys.stdout.flush()
    _err(f"stopped: {seq.stop_reason}" + (f" ({seq.stop_detail!r})" if seq.stop_detail is not None else ""))
    if FLAGS.show_stats:
        from minimax_jax.ops import implementation_report

        _err(out.stats.summary())
        _err(f"attention: {model.attention_note}")
        _err("implementations: " + ", ".join(f"{k}={v}" for k, v in sorted(implementation_report().items())))
    return 0


def _generate(gen, model, prompt, config, chunk):
    import contextlib

    from tqdm.auto import tqdm

    def on_text(_row, delta):
        sys.stdout.write(delta)
        sys.stdout.flush()

    long_prefill = len(prompt) > chunk
    ctx = contextlib.nullcontext()
    if model.mesh is not None:
        from minimax_jax.sharding import use_mesh

        ctx = use_mesh(model.mesh, model.rules)
    with ctx, tqdm(total=len(prompt), desc="prefill", unit="tok", disable=not long_prefill, file=sys.stderr,
                   dynamic_ncols=True, leave=False) as bar:
        return gen.generate([prompt], config, on_text=on_text if FLAGS.stream else None,
                            on_prefill_tokens=bar.update)


def main(argv) -> None:
    """absl entry point."""
    from absl import logging as absl_logging

    if not FLAGS["verbosity"].present:  # orbax logs every restore step at INFO; keep stderr readable
        absl_logging.set_verbosity(absl_logging.WARNING)
    if len(argv) > 1:
        _err(f"error: unexpected arguments {argv[1:]} (flags are --name=value; see --help)")
        sys.exit(2)
    if FLAGS["sharding_rules"].present and not FLAGS.mesh:
        _err("error: --sharding_rules applies only with --mesh (the parameters are sharded by those rules over "
             "that mesh); pass --mesh too, e.g. --mesh fsdp=-1")
        sys.exit(2)
    from minimax_jax.chat import ChatFormatError
    from minimax_jax.config import ConfigError
    from minimax_jax.convert.errors import CheckpointError
    from minimax_jax.infer.errors import InferenceError

    try:
        code = run()
    except (InferenceError, ChatFormatError, ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        _err(f"error: {e}")
        code = 1
    sys.exit(code)
