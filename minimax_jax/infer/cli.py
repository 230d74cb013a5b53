"""Command line for ``python infer.py`` (flags below; ``--help`` explains each).

Prompts: one of ``--prompt``, ``--prompt_file``, ``--chat_file`` or ``--prompts_file`` (JSONL, several
prompts, batched through the engine; ``minimax_jax.infer.prompts_io``), each sampled ``--n`` times.

Output on stdout: as text (``minimax_jax.infer.cli_output``: the prompt echoed under a ``--- prompt ---``
line, each generation under a ``--- generation ---`` line; chat turns parsed into reasoning, content
and tool calls as JSON after ``--- parsed output (JSON) ---``), or with ``--json`` only JSONL records
(``prompts_io`` module doc), or the records into ``--output FILE``. Loading messages, the engine line
(once), a prefill progress bar and the statistics (TTFT, steady-state tokens/s with compilation apart,
acceptance rate) go to stderr. Exit status (``minimax_jax.exit_codes``), each error one
``infer.py: error: ...`` line (``--debug`` adds the traceback): 0 ok; 1 a runtime failure (checkpoint
content, engine); 2 a usage error or bad input (flags, missing / malformed prompt, chat or checkpoint
files, a prompt too long for the context, a KV cache for the longest prompt + --max_new_tokens x --batch_size
larger than the memory left: checked before it is allocated); 130 interrupted (Ctrl-C: generation stops between steps, the
records finished so far are written, one line says so; a second Ctrl-C aborts at once).
"""

from __future__ import annotations

import sys

import argparse

from minimax_jax import cli_main
from minimax_jax.exit_codes import INTERRUPTED, UsageError

PROG = "infer.py"
#: The parsed flags (``parse``); updated in place, so ``from ... import FLAGS`` sees them.
FLAGS = argparse.Namespace()


AUTO_DECODE_LOOP = 16
MAX_DECODE_LOOP = 256       # the engine reserves cache room for one loop past a row's limit


def _decode_loop_arg(s: str):
    """argparse type of --decode_loop: "auto" or an integer in [1, MAX_DECODE_LOOP]."""
    if s == "auto":
        return s
    try:
        return cli_main.int_at_least(1, MAX_DECODE_LOOP)(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f'expected "auto" or an integer in [1, {MAX_DECODE_LOOP}], got {s!r}') from None


def build_parser() -> argparse.ArgumentParser:
    p = cli_main.Parser(prog=PROG, description="Generate text with a MiniMax-M2 / M3 checkpoint.")
    p.add_argument("--checkpoint", default=None, help='Checkpoint directory: a converted minimax-jax checkpoint '
                                                      '(config.yaml + params/) or a Hugging Face directory '
                                                      '(config.json + *.safetensors, converted on the fly). '
                                                      'Default: the shipped demo checkpoint checkpoints/demo/.')
    p.add_argument("--tokenizer", default=None, help='tokenizer.json (or its directory); default: tokenizer.json '
                                                     'in --checkpoint.')
    p.add_argument("--prompt", default=None, help='Prompt text, continued as is (no chat template).')
    p.add_argument("--prompt_file", default=None, help='File whose text is the prompt (no chat template).')
    p.add_argument("--prompts_file", default=None, help='JSONL file of prompts, one JSON object per line: '
                                                        '{"prompt": ...} or {"messages": [...], "tools": [...]}, '
                                                        'optional "id" and "max_new_tokens"; batched through the '
                                                        'engine, one output record per prompt and sample.')
    p.add_argument("--chat_file", default=None, help='Chat JSON {"messages": [...], "tools": [...]} rendered with '
                                                     'the MiniMax chat template; the reply is parsed into '
                                                     'reasoning, content and tool calls (printed as JSON).')
    p.add_argument("--context_file", default=None, help='Long document put before the prompt (with --chat_file: '
                                                        'at the start of the first user message), for '
                                                        'long-context questions.')
    p.add_argument("--max_new_tokens", type=cli_main.int_at_least(1), default=256, help='Most tokens to generate.')
    p.add_argument("--temperature", type=cli_main.float_in(0.0), default=1.0, help='Sampling temperature; 0 = '
                                                                                   'greedy (argmax).')
    p.add_argument("--top_p", type=cli_main.float_in(None, 1.0), default=0.95, help='Nucleus sampling mass in (0, '
                                                                                    '1] (1 = off).')
    p.add_argument("--top_k", type=cli_main.int_at_least(0), default=40, help='Keep the k most likely tokens (0 = '
                                                                              'off).')
    p.add_argument("--min_p", type=cli_main.float_in(0.0), default=0.0, help='Drop tokens below min_p x the top '
                                                                             'probability (0 = off).')
    p.add_argument("--seed", type=cli_main.int_at_least(0, cli_main.SEED_MAX), default=0,
                   help=f'Random seed in [0, {cli_main.SEED_MAX}]; the same seed and inputs give the same output '
                        '(sample j of a prompt draws the same whatever else is in the batch).')
    p.add_argument("--n", type=cli_main.int_at_least(1), default=1, help='Samples per prompt.')
    p.add_argument("--repetition_penalty", type=cli_main.float_in(0.0), default=1.0, help='Repetition penalty '
                                                                                          '(Hugging Face / CTRL): '
                                                                                          'logits of tokens in '
                                                                                          'the prompt or the '
                                                                                          'generated text are '
                                                                                          'divided by it when '
                                                                                          'positive, multiplied '
                                                                                          'when negative (1 = '
                                                                                          'off, > 1 discourages '
                                                                                          'repeats).')
    p.add_argument("--presence_penalty", type=cli_main.float_in(-2.0, 2.0), default=0.0, help='Presence penalty '
                                                                                              '(OpenAI): '
                                                                                              'subtracted from '
                                                                                              'the logit of every '
                                                                                              'token already '
                                                                                              'generated (0 = '
                                                                                              'off; in [-2, 2]).')
    p.add_argument("--frequency_penalty", type=cli_main.float_in(-2.0, 2.0), default=0.0, help='Frequency penalty '
                                                                                               '(OpenAI): times '
                                                                                               'its count in the '
                                                                                               'generated text, '
                                                                                               'subtracted from a '
                                                                                               "token's logit (0 "
                                                                                               '= off; in [-2, '
                                                                                               '2]).')
    p.add_argument("--stop", action="append", default=None, help='Stop string (repeatable); the output is cut '
                                                               'before it.')
    p.add_argument("--repeat_max_period", type=cli_main.int_at_least(0), default=0, help='Stop on a repeated '
                                                                                         'token cycle of at most '
                                                                                         'this length (with '
                                                                                         '--repeat_max_count; 0 = '
                                                                                         'off).')
    p.add_argument("--repeat_max_count", type=cli_main.int_at_least(0), default=0, help='Stop once such a cycle '
                                                                                        'repeats more than this '
                                                                                        'many times.')
    cli_main.add_bool(p, "stream", False, 'Print text as it is generated (several prompts / samples are then '
        'generated one at a time).', absl_alias=True)
    cli_main.add_bool(p, "json", False, 'Print only JSONL records on stdout (one per prompt and sample: id, '
        'sample, tokens, text, stop reason, logprobs, parsed chat turn); nothing else goes to stdout.', absl_alias=True)
    p.add_argument("--output", default=None, help='Write the JSONL records to this file (refused if it exists, '
                                                  'unless --overwrite); stdout keeps the text output.')
    cli_main.add_bool(p, "overwrite", False, 'Let --output replace an existing file (the records go to '
                      'FILE.partial and replace FILE when the run completes; an interrupted run keeps FILE).',
                      absl_alias=True)
    cli_main.add_bool(p, "logprobs", False, "Add each generated token's log-probability under the model (raw "
        'logits, before penalties, temperature and filters) to the records.', absl_alias=True)
    cli_main.add_bool(p, "bos", False, "Start each raw prompt (not a chat: the template renders its own) with the "
        "BOS token ]~!b[, as every training document starts (the eval CLI's --bos); a base model such as the demo "
        "continues prompts in the style it was trained on only with it.", absl_alias=True)
    cli_main.add_bool(p, "echo_prompt", True, "Text output: print each prompt (under '--- prompt ---') before its "
        'generations.', absl_alias=True)
    p.add_argument("--batch_size", type=cli_main.int_at_least(1), default=16, help='Rows (prompt x sample) '
                                                                                   'generated together by the '
                                                                                   'engine.')
    p.add_argument("--speculative", choices=("none", "mtp"), default="none", help="Speculative decoding: 'mtp' "
                   "drafts tokens with the model's MTP modules and verifies them in one step (same output "
                   'distribution; greedy output identical with --decode_rows 1 + drafts, README: without it bf16 '
                   'near-ties may round differently); the acceptance rate is reported. Greedy (--temperature '
                   '0) with --decode_loop N > 1: N speculative steps (drafting, verification, acceptance) run in one '
                   'compiled device loop per host round trip.')
    p.add_argument("--decode_loop", type=_decode_loop_arg, default="auto", help='Greedy decoding: run this '
                   'many decode steps in one compiled device loop per host round trip (paged engine; greedy, no '
                   'penalties, no --logprobs). With --speculative mtp each step is a speculative one (draft, verify, '
                   'accept on the device; 1 + drafts tokens of cache room per step). The same tokens as one step at '
                   'a time; text streams and stop conditions are checked once per loop, and up to N - 1 steps past a '
                   f'stop are computed and dropped. "auto" (default): {AUTO_DECODE_LOOP} (at most --max_new_tokens) '
                   'where all of that holds, without --speculative and --decode_rows, else 1 (the run summary names '
                   f'the loop). At most {MAX_DECODE_LOOP}.')
    p.add_argument("--num_draft", type=int, default=None, help='Drafts per step with --speculative mtp (default: '
                                                               'all MTP modules).')
    p.add_argument("--mtp_window", type=cli_main.int_at_least(1), default=None, help='Positions the MTP layers '
                   'attend over while drafting with --speculative mtp (default 64, at most 8192; each draft step runs '
                   'the MTP layers over this many tokens; larger = better drafts, slower; useful up to num_draft x '
                   '(W - 1) + 1 for a model whose mtp_attention_window is W, and never past the longest row).')
    p.add_argument("--engine", choices=("paged", "recompute"), default="paged", help="Generation engine: 'paged' "
                                                                                     '= KV-cache decode engine '
                                                                                     '(minimax_jax.decode); '
                                                                                     "'recompute' = full forward "
                                                                                     'each step (slow; for '
                                                                                     'checking).')
    p.add_argument("--prefill_chunk", type=cli_main.int_at_least(0), default=0, help='Prompt tokens per prefill '
                                                                                     'step of the paged engine; 0 '
                                                                                     '= by prompt length (GPU: '
                                                                                     'length // 8 in [256, '
                                                                                     '16384]; elsewhere 256).')
    p.add_argument("--decode_rows", type=cli_main.int_at_least(1), default=None, help='Pad every decode step of the '
                   'paged engine to this many query rows (1-16; default: each step its own row count). Two runs with '
                   'the same value run every matrix product at the same shapes and round each row as it would alone: '
                   'a --speculative mtp run then gives exactly the greedy tokens of a plain one, on the CPU and the '
                   'GPU (use 1 + drafts, e.g. 2 for one MTP module).')
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help='Parameter and compute dtype: '
                                                                                  'the parameters are cast to it '
                                                                                  'on load (default: the '
                                                                                  "checkpoint's own, its "
                                                                                  'config.yaml dtype / '
                                                                                  'param_dtype); also the dtype '
                                                                                  'of an on-the-fly Hugging Face '
                                                                                  'conversion (default bfloat16).')
    p.add_argument("--weights_dtype", choices=("fp8",), default=None, help='fp8: keep the FP8 e4m3 layer weights '
                   '(with their 128x128 block scales) of an FP8 checkpoint in FP8 in device memory, dequantised '
                   'inside each step (about half the weight memory of bf16); the checkpoint must hold them (ours: '
                   'converted with --weights_dtype fp8; or an FP8 Hugging Face directory). Default: dequantise.')
    cli_main.add_mesh(p)
    p.add_argument("--convert_dir", default=None, help='Keep the on-the-fly conversion of a Hugging Face '
                                                       'checkpoint here (reused by later runs) instead of a '
                                                       'temporary directory.')
    p.add_argument("--attention", choices=("as_trained", "dense"), default="as_trained", help='Attention of the '
                                                                                              "model's MSA "
                                                                                              'layers: '
                                                                                              "'as_trained' = as "
                                                                                              'the checkpoint '
                                                                                              'says (MSA top-k '
                                                                                              'block selection); '
                                                                                              "'dense' = run "
                                                                                              'every MSA layer as '
                                                                                              'full causal '
                                                                                              'attention with the '
                                                                                              'same weights (its '
                                                                                              'indexer weights '
                                                                                              'are unused): the '
                                                                                              'dense baseline of '
                                                                                              'the same '
                                                                                              'checkpoint. What '
                                                                                              'ran is printed '
                                                                                              'with the '
                                                                                              'statistics.')
    cli_main.add_bool(p, "show_stats", True, 'Print generation statistics (and the op implementations that ran) '
        'to stderr.', absl_alias=True)
    p.add_argument("--verbosity", type=int, default=None, help="absl / orbax log level (default: warnings only)")
    return cli_main.add_common(p, cache=True)


def parse(argv) -> argparse.Namespace:
    """Parse ``argv`` (no program name) into ``FLAGS``; argparse exits 2 on a bad flag."""
    ns = cli_main.parse_args(build_parser(), argv)
    FLAGS.__dict__.clear()
    FLAGS.__dict__.update(vars(ns))
    return FLAGS


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8-sig") as f:      # a byte-order mark is not part of the prompt
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path!r} is not UTF-8 text (byte {e.start})") from None


SOURCES = ("prompt", "prompt_file", "chat_file", "prompts_file")


def build_items() -> list:
    """The prompts (``prompts_io.PromptItem``) from the flags, --context_file applied.

    Raises: ValueError when zero or several prompt sources are given or a file is unreadable / bad;
    ChatFormatError for bad chats.
    """
    from minimax_jax.chat import load_chat_file
    from minimax_jax.infer.prompts_io import PromptItem, read_prompts_file, with_context

    given = [n for n in SOURCES if getattr(FLAGS, n) is not None]
    if len(given) != 1:
        raise ValueError("give exactly one of " + ", ".join("--" + n for n in SOURCES)
                         + (f" (got {', '.join('--' + g for g in given)})" if given else ""))
    context = _read(FLAGS.context_file, "--context_file") if FLAGS.context_file else None
    if FLAGS.prompts_file:
        items = read_prompts_file(FLAGS.prompts_file)
    elif FLAGS.chat_file:
        try:
            req = load_chat_file(FLAGS.chat_file)
        except OSError as e:
            raise ValueError(f"cannot read --chat_file {FLAGS.chat_file!r}: {e.strerror}") from None
        items = [PromptItem(0, 0, req.render(), req, where=FLAGS.chat_file)]
    else:
        text = FLAGS.prompt if FLAGS.prompt is not None else _read(FLAGS.prompt_file, "--prompt_file")
        items = [PromptItem(0, 0, text)]
    return items if context is None else [with_context(it, context) for it in items]


def check_flags() -> None:
    """Raise UsageError for flag combinations that cannot work."""
    if FLAGS.sharding_rules is not None and not FLAGS.mesh:
        raise UsageError("--sharding_rules applies only with --mesh (the parameters are sharded by those rules "
                         "over that mesh); pass --mesh too, e.g. --mesh fsdp=-1")
    if FLAGS.json and FLAGS.output:
        raise UsageError("--json prints the records on stdout and --output writes them to a file: pick one")
    if FLAGS.json and FLAGS.stream:
        raise UsageError("--stream prints text as it comes; --json prints only JSON records: pick one")
    if FLAGS.logprobs and not (FLAGS.json or FLAGS.output):
        raise UsageError("--logprobs adds log-probabilities to the JSON records: pass --json or --output too")
    if FLAGS.overwrite and not FLAGS.output:
        raise UsageError("--overwrite applies only with --output")
    for flag in ("num_draft", "mtp_window"):
        if getattr(FLAGS, flag) is not None and FLAGS.speculative == "none":
            raise UsageError(f"--{flag} needs --speculative mtp")
    # (sampling and logprobs with an explicit loop: GenerationConfig refuses them)
    if FLAGS.decode_loop != "auto" and FLAGS.decode_loop > 1 and FLAGS.engine != "paged":
        raise UsageError("--decode_loop > 1 needs --engine paged")
    if FLAGS.decode_rows is not None and (FLAGS.engine != "paged" or FLAGS.decode_rows > 16):
        raise UsageError("--decode_rows needs --engine paged and a value in [1, 16]")
    if FLAGS.decode_rows is not None and FLAGS.speculative != "none" and FLAGS.num_draft is not None \
            and FLAGS.decode_rows < 1 + FLAGS.num_draft:
        raise UsageError(f"--decode_rows {FLAGS.decode_rows} cannot hold 1 + {FLAGS.num_draft} drafts per step")


def _config():
    from minimax_jax.infer.generation import GenerationConfig
    from minimax_jax.infer.sampler import SamplingParams

    sampling = SamplingParams(FLAGS.temperature, FLAGS.top_p, FLAGS.top_k, FLAGS.min_p, FLAGS.seed,
                              FLAGS.repetition_penalty, FLAGS.presence_penalty, FLAGS.frequency_penalty)
    return GenerationConfig(
        max_new_tokens=FLAGS.max_new_tokens, sampling=sampling,
        stop_strings=tuple(FLAGS.stop or ()), repeat_max_period=FLAGS.repeat_max_period,
        repeat_max_count=FLAGS.repeat_max_count,
        speculative=None if FLAGS.speculative == "none" else FLAGS.speculative,
        num_draft=FLAGS.num_draft, mtp_window=64 if FLAGS.mtp_window is None else FLAGS.mtp_window,
        logprobs=FLAGS.logprobs,
        decode_loop=resolve_decode_loop(FLAGS.decode_loop, sampling, engine=FLAGS.engine, logprobs=FLAGS.logprobs,
                                        speculative=FLAGS.speculative != "none", decode_rows=FLAGS.decode_rows,
                                        max_new_tokens=FLAGS.max_new_tokens))


def resolve_decode_loop(value, sampling, *, engine, logprobs, speculative, decode_rows, max_new_tokens) -> int:
    """``--decode_loop`` as run: an int as given (with --speculative: speculative steps per loop); "auto" =
    ``min(AUTO_DECODE_LOOP, max_new_tokens)`` steps per device loop for greedy plain decoding without penalties
    or logprobs on the paged engine with no --decode_rows (one host round trip per 16 tokens; 8 and 32 measured
    in BENCHMARKS.md, speculative decoding), else 1 (also with --speculative: the speculative loop only when
    asked for)."""
    if value != "auto":
        return value
    eligible = (engine == "paged" and sampling.greedy and not sampling.has_penalties and not logprobs
                and not speculative and decode_rows is None)
    return max(1, min(AUTO_DECODE_LOOP, max_new_tokens)) if eligible else 1


def _encode(items, tokenizer, cfg, config, bos: bool = False) -> list:
    from minimax_jax.chat.tokens import BOS
    from minimax_jax.infer.errors import ContextTooLong
    from minimax_jax.infer.generation import check_context

    bos_id = tokenizer.token_to_id(BOS) if bos else None
    if bos and bos_id is None:
        raise ValueError(f"--bos: the tokenizer has no BOS token {BOS!r}")
    ids = []
    for it in items:
        p = tokenizer.encode(it.text, add_special_tokens=False).ids
        if not p:
            raise ValueError(f"{it.where} is empty (it encodes to no tokens)")
        if bos_id is not None and it.chat is None and p[0] != bos_id:
            p = [bos_id, *p]
        try:
            # a per-line max_new_tokens goes as a list: the advice then names the line's value too
            check_context(cfg, [len(p)], [it.max_new_tokens] if it.max_new_tokens else config.max_new_tokens)
        except ContextTooLong as e:
            raise ContextTooLong(str(e) if len(items) == 1 else f"{it.where}: {e}") from None
        ids.append(p)
    return ids


def run() -> int:
    """Run the CLI with the parsed flags; returns the exit status."""
    from minimax_jax.infer.backends import auto_prefill_chunk
    from minimax_jax.infer.cli_output import Output
    from minimax_jax.infer.generation import Generator
    from minimax_jax.infer.loading import (check_tokenizer_fits, check_weights_dtype, load_model, load_tokenizer_for,
                                           peek_config, resolve_checkpoint)

    check_flags()
    items = build_items()
    config = _config()
    # Cheap checks first (tokenizer, config, context length, output file), then the parameters.
    ckpt = resolve_checkpoint(FLAGS.checkpoint)
    check_weights_dtype(ckpt, FLAGS.weights_dtype)
    cfg = peek_config(ckpt)
    tokenizer = load_tokenizer_for(ckpt, FLAGS.tokenizer)
    check_tokenizer_fits(tokenizer, cfg, FLAGS.tokenizer or ckpt)
    prompts = _encode(items, tokenizer, cfg, config, bos=FLAGS.bos)
    if FLAGS.n > 1 and config.sampling.greedy:
        _err(f"warning: --n {FLAGS.n} with --temperature 0 (greedy) gives {FLAGS.n} identical samples")
    from minimax_jax.decode import mesh_attention
    from minimax_jax.sharding import load_rules

    seq_devices = (mesh_attention.sequence_devices(FLAGS.mesh, load_rules(FLAGS.sharding_rules or "default"))
                   if FLAGS.engine == "paged" else 1)
    try:
        chunk = mesh_attention.prefill_chunk(seq_devices, FLAGS.prefill_chunk or auto_prefill_chunk(
            max(map(len, prompts))), explicit=bool(FLAGS.prefill_chunk))
    except ValueError as e:
        raise UsageError(str(e)) from None
    cli_main.enable_compilation_cache(FLAGS.compilation_cache, prog=PROG)
    out = Output(total=len(items), n=FLAGS.n, json=FLAGS.json, echo=FLAGS.echo_prompt, output=FLAGS.output,
                 overwrite=FLAGS.overwrite, sources=(FLAGS.prompts_file, FLAGS.prompt_file, FLAGS.chat_file),
                 logprobs=FLAGS.logprobs)
    complete = False             # a replaced --output file is swapped in only after a whole run
    try:
        model = load_model(ckpt, tokenizer_path=FLAGS.tokenizer, dtype=FLAGS.dtype, mesh=FLAGS.mesh,
                           rules=FLAGS.sharding_rules or "default", convert_dir=FLAGS.convert_dir, attention=FLAGS.attention,
                           log=_err, weights_dtype=FLAGS.weights_dtype)
        where = "single device" if model.mesh is None else "mesh " + ",".join(
            f"{k}={v}" for k, v in model.mesh.shape.items() if v > 1)
        _err(f"model: {model.checkpoint_dir} [{model.source}], {model.cfg.num_layers} layers, "
             f"vocab {model.cfg.vocab_size}, context {model.cfg.max_position_embeddings}, {where}")
        have = model.cfg.num_mtp_modules if "mtp" in model.params else 0
        if FLAGS.speculative != "none" and FLAGS.num_draft is not None and not 1 <= FLAGS.num_draft <= min(have, 15):
            raise UsageError(f"--num_draft {FLAGS.num_draft}: this model has {have} MTP modules, so 1..{min(have, 15)} "
                             "drafts per step")
        if seq_devices > 1:
            _err(f"prefill: context parallel over sequence={seq_devices}, {chunk}-token chunks "
                 f"({chunk // seq_devices} per device)")
        if model.mesh is not None and FLAGS.engine == "paged":
            if line := mesh_attention.describe_cache(model.cfg, model.mesh, model.rules):
                _err(line)
        opts = {"prefill_chunk": chunk}
        if FLAGS.decode_rows is not None:
            opts["query_rows"] = FLAGS.decode_rows
        gen = Generator(model.cfg, model.params, model.tokenizer, engine=FLAGS.engine,
                        engine_options=opts if FLAGS.engine == "paged" else None, log=_err)
        rc = _generate_all(gen, model, items, prompts, config, chunk, out)
        complete = rc == 0
        return rc
    finally:
        out.close(complete)


def _generate_all(gen, model, items, prompts, config, chunk, out) -> int:
    import contextlib

    from tqdm.auto import tqdm

    from minimax_jax.decode.engine import CacheTooLarge
    from minimax_jax.interrupt import InterruptFlag
    from minimax_jax.infer.metrics import combine_stats

    rows = [(i, j) for i in range(len(items)) for j in range(FLAGS.n)]
    limit = [items[i].max_new_tokens or config.max_new_tokens for i, _ in rows]
    batch = 1 if FLAGS.stream else FLAGS.batch_size
    extra = config.tokens_past_limit((config.num_draft or min(model.cfg.num_mtp_modules, 15)) if config.speculative
                                     else 0)
    ctx = contextlib.nullcontext()
    if model.mesh is not None:      # the engine is built inside it: its KV cache is sharded by kv head
        from minimax_jax.sharding import use_mesh

        ctx = use_mesh(model.mesh, model.rules)
    stats, reasons = [], {}
    with ctx, InterruptFlag() as stop:
        # The engine (and its one "engine:" line) before any progress bar, sized for every batch.
        try:
            gen.reserve(min(batch, len(rows)), max(len(prompts[i]) + m for (i, _), m in zip(rows, limit)) + extra,
                        config.speculative is not None)
        except CacheTooLarge as e:    # checked before the cache is allocated
            raise UsageError(f"{e}; lower --max_new_tokens (or \"max_new_tokens\" in --prompts_file), --batch_size "
                             "or the prompt") from None
        for b in range(0, len(rows), batch):
            part = rows[b:b + batch]
            ps = [prompts[i] for i, _ in part]
            if FLAGS.stream:
                out.start(items[part[0][0]], part[0][1])
            with tqdm(total=sum(map(len, ps)), desc="prefill", unit="tok", disable=max(map(len, ps)) <= chunk,
                      file=sys.stderr, dynamic_ncols=True, leave=False) as bar:
                res = gen.generate(ps, config, on_text=(lambda _r, d: out.delta(d)) if FLAGS.stream else None,
                                   on_prefill_tokens=bar.update, row_ids=[j for _, j in part],
                                   max_new_tokens=limit[b:b + batch], should_stop=stop)
            stats.append(res.stats)
            for (i, j), seq in zip(part, res.sequences):
                if seq.stop_reason == "interrupted":
                    out.interrupted_row()
                    continue
                _finish_row(out, items[i], j, seq, len(prompts[i]))
                reasons[seq.stop_reason] = reasons.get(seq.stop_reason, 0) + 1
            if res.interrupted:
                sys.stdout.flush()
                where = ""
                if out.file is not None:
                    where = f"; records in {out.file.where}" + (
                        f" ({FLAGS.output} kept as it was)" if out.file.where != FLAGS.output else "")
                _err(f"interrupted (Ctrl-C): {out.records} of {len(rows)} generations finished{where}")
                return INTERRUPTED
    _report(reasons, combine_stats(stats), model)
    return 0


def _finish_row(out, item, sample, seq, prompt_tokens) -> None:
    parsed = None
    if item.chat is not None:
        from minimax_jax.chat import parse_model_output

        parsed = parse_model_output(seq.text, item.chat.tools)
        for e in parsed.errors:
            name = "" if out.total == 1 and out.n == 1 else f" (id {item.id}, sample {sample})"
            _err(f"warning: malformed tool call output{name} ({e.kind}): {e.message}")
    out.done(item, sample, seq, prompt_tokens, parsed)


def _report(reasons: dict, stats, model) -> None:
    from minimax_jax.infer.prompts_io import STOP_REASONS

    if sum(reasons.values()) == 1:
        (reason,) = reasons
        _err(f"stopped: {STOP_REASONS.get(reason, reason)}")
    else:
        _err("stopped: " + ", ".join(f"{n} {STOP_REASONS.get(r, r)}" for r, n in sorted(reasons.items())))
    if FLAGS.show_stats:
        from minimax_jax.ops import implementation_report

        _err(stats.summary())
        _err(f"attention: {model.attention_note}")
        _err("implementations: " + ", ".join(f"{k}={v}" for k, v in sorted(implementation_report().items())))


def main(argv=None) -> int:
    """Entry point: ``argv`` without the program name (default ``sys.argv[1:]``); returns the exit status."""
    from minimax_jax.chat import ChatFormatError
    from minimax_jax.config import ConfigError
    from minimax_jax.convert.errors import CheckpointError
    from minimax_jax.infer.errors import (CheckpointNotFound, ContextTooLong, ConversionMismatch,
                                          Fp8WeightsUnavailable, InferenceError, TokenizerNotFound)

    return cli_main.run(_main, argv, prog=PROG, hard_interrupt=True,
                        usage=(ValueError, ChatFormatError, CheckpointNotFound, TokenizerNotFound, ContextTooLong,
                               Fp8WeightsUnavailable, ConversionMismatch),
                        failure=(InferenceError, ConfigError, CheckpointError))


def _main(argv) -> int:
    from absl import logging as absl_logging

    parse(argv)
    # orbax logs every restore step at INFO; keep stderr readable
    absl_logging.set_verbosity(absl_logging.WARNING if FLAGS.verbosity is None else FLAGS.verbosity)
    return run()
