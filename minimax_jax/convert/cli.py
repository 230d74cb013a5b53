"""Command line for checkpoint conversion.

    python -m minimax_jax.convert --src HF_DIR --dst OUT_DIR [--dtype bfloat16|float32] [--weights_dtype fp8]
    python -m minimax_jax.convert --export --src OUT_DIR --dst HF_DIR [--fp8] [--max_shard_mb 5120]

``--fp8``, ``--max_shard_mb`` and ``--[no_]verify`` only apply with ``--export``; given without it they are a
usage error (exit status 2), not ignored.

Exit status (``minimax_jax.exit_codes``): 0 on success, 2 for bad arguments or the wrong kind of source
(a missing --src, or one without a valid config.json / config.yaml, a field of the wrong type; --weights_dtype
fp8 on a source without FP8 weights; a --dst that exists without --overwrite, overlaps --src, sits under a
file, or was not written by this tool: nothing is touched), 1 for a checkpoint error (the message names
the tensor; the destination is not created), 130 interrupted. The kebab-case flags of earlier versions
(``--max-shard-gb``, ``--no-verify``, ...) still work with a one-line deprecation warning.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from minimax_jax import cli_main

PROG = "python -m minimax_jax.convert"
#: Renamed flags: old spelling -> (new, value conversion).
RENAMED = {"--max-shard-gb": ("--max_shard_mb", lambda v: float(v) * 1024), "--no-verify": ("--no_verify", None),
           "--in-flight": ("--in_flight", None), "--chunk-mb": ("--chunk_mb", None),
           "--no-progress": ("--no_progress", None)}

__all__ = ["main", "build_parser"]

DEFAULT_MAX_SHARD_MB = 2048.0


def build_parser() -> argparse.ArgumentParser:
    p = cli_main.Parser(
        prog=PROG,
        description="Convert MiniMax-M2/M3 Hugging Face safetensors checkpoints (BF16/F32 or FP8 e4m3 with "
                    "128x128 weight_scale_inv) to a minimax-jax orbax checkpoint directory, or back with --export. "
                    "Streams layer by layer; output is written to a hidden temporary directory next to --dst and "
                    "renamed when complete.")
    p.add_argument("--src", required=True, help="input directory (HF checkpoint, or ours with --export)")
    p.add_argument("--dst", required=True, help="output directory (must not exist unless --overwrite)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="parameter dtype of the orbax checkpoint (router weights stay float32); default bfloat16")
    p.add_argument("--weights_dtype", choices=["fp8"], default=None,
                   help="fp8: keep an FP8 checkpoint's e4m3 layer weights (attention, experts, MLPs) in FP8 with "
                        "their block scales (about half the bytes of bfloat16; load with infer.py --weights_dtype "
                        "fp8); default: dequantise them to --dtype")
    p.add_argument("--export", action="store_true", help="orbax -> HF safetensors instead of HF -> orbax")
    p.add_argument("--fp8", action="store_true", help="with --export: re-quantise layer weights to FP8 e4m3 + "
                                                      "128x128 weight_scale_inv (the M2 hub format)")
    p.add_argument("--max_shard_mb", type=cli_main.float_in(1e-9), default=None,
                   help=f"with --export: shard size limit in MiB (default: {DEFAULT_MAX_SHARD_MB:g})")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --dst if it exists and was written by this tool (after success only)")
    cli_main.add_bool(p, "verify", None, "with --export: check --src against its checksum manifest (default: on)")
    p.add_argument("--in_flight", type=cli_main.int_at_least(1), default=2,
                   help="layer units (one layer of one leaf) assembled/written at once; peak memory grows with it")
    p.add_argument("--chunk_mb", type=cli_main.int_at_least(1), default=128,
                   help="orbax storage chunk size bound in MiB")
    p.add_argument("--compress", action="store_true", help="zstd-compress orbax chunks (smaller, slower)")
    cli_main.add_bool(p, "progress", True, "a progress bar")
    cli_main.aliases(p).update(RENAMED)
    return cli_main.add_common(p)


def main(argv: list[str] | None = None) -> int:
    """Entry point (``argv`` without the program name); returns the exit status."""
    from minimax_jax.config import ConfigError
    from minimax_jax.convert.errors import CheckpointError, DestinationError, SourceKindError

    # DestinationError: the destination changed since the check before the work; ConfigError: --src's config
    return cli_main.run(_main, argv, prog=PROG, usage=(DestinationError, ConfigError, SourceKindError),
                        failure=(CheckpointError,))


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = cli_main.parse_args(parser, argv)
    if not args.export:
        given = (["--fp8"] if args.fp8 else []) + (["--max_shard_mb"] if args.max_shard_mb is not None else []) + (
            [] if args.verify is None else ["--verify" if args.verify else "--no_verify"])
        if given:
            parser.error(f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} with --export (orbax -> "
                         f"HF safetensors); add --export or drop {'it' if len(given) == 1 else 'them'}")
    max_shard_mb = DEFAULT_MAX_SHARD_MB if args.max_shard_mb is None else args.max_shard_mb
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from minimax_jax.convert.atomic_dir import check_destination
    from minimax_jax.convert.errors import DestinationError, DestinationExistsError

    if not os.path.isdir(args.src):
        what = "is not a directory" if os.path.exists(args.src) else "directory does not exist"
        print(f"{PROG}: error: --src {args.src}: {what}", file=sys.stderr)
        return 2
    try:
        check_destination(args.dst, sources=(args.src,), overwrite=args.overwrite,
                          kind="hf" if args.export else "orbax")
    except DestinationExistsError:
        print(f"{PROG}: error: --dst {args.dst} already exists; pass --overwrite to replace it, or choose another "
              "--dst", file=sys.stderr)
        return 2
    except DestinationError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if args.export and args.weights_dtype:
        print(f"{PROG}: error: --weights_dtype applies to HF -> orbax conversion; with --export, --fp8 writes FP8 "
              "(FP8 leaves of --src are written as stored)", file=sys.stderr)
        return 2
    if args.export:
        from minimax_jax.convert.export import export_orbax_to_hf

        out = export_orbax_to_hf(args.src, args.dst, fp8=args.fp8, overwrite=args.overwrite,
                                 max_shard_bytes=int(max_shard_mb * 1024 ** 2),
                                 progress=args.progress, verify=args.verify is not False)
        print(f"wrote {out['tensors']} tensors ({out['bytes'] / 1e9:.3f} GB) in {out['shards']} shard(s) to {args.dst}")
    else:
        from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax

        cfg, rep = convert_hf_to_orbax(args.src, args.dst, args.dtype, overwrite=args.overwrite,
                                       progress=args.progress, chunk_bytes=args.chunk_mb * 1024 ** 2,
                                       compress=args.compress, max_in_flight=args.in_flight,
                                       weights_dtype=args.weights_dtype)
        gb = rep["source_bytes"] / 1e9
        print(f"converted {rep['source_tensors']} tensors ({gb:.3f} GB) in {rep['seconds']:.1f} s "
              f"({gb / max(rep['seconds'], 1e-9):.3f} GB/s) to {args.dst}")
    return 0
