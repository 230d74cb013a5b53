"""Command line for checkpoint conversion.

    python -m minimax_jax.convert --src HF_DIR --dst OUT_DIR [--dtype bfloat16|float32]
    python -m minimax_jax.convert --export --src OUT_DIR --dst HF_DIR [--fp8] [--max-shard-gb 5]

Exit status: 0 on success, 2 for bad arguments (a --dst that exists without --overwrite, overlaps
--src, or was not written by this tool: nothing is touched), 1 for a checkpoint / config error (the
message names the tensor or field; the destination is not created).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minimax_jax.convert",
        description="Convert MiniMax-M2/M3 Hugging Face safetensors checkpoints (BF16/F32 or FP8 e4m3 with "
                    "128x128 weight_scale_inv) to a minimax-jax orbax checkpoint directory, or back with --export. "
                    "Streams layer by layer; output is written to a hidden temporary directory next to --dst and "
                    "renamed when complete.")
    p.add_argument("--src", required=True, help="input directory (HF checkpoint, or ours with --export)")
    p.add_argument("--dst", required=True, help="output directory (must not exist unless --overwrite)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="parameter dtype of the orbax checkpoint (router weights stay float32); default bfloat16")
    p.add_argument("--export", action="store_true", help="orbax -> HF safetensors instead of HF -> orbax")
    p.add_argument("--fp8", action="store_true", help="with --export: re-quantise layer weights to FP8 e4m3 + "
                                                      "128x128 weight_scale_inv (the M2 hub format)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="with --export: shard size limit in GiB")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --dst if it exists and was written by this tool (after success only)")
    p.add_argument("--no-verify", action="store_true",
                   help="with --export: skip checking --src against its checksum manifest")
    p.add_argument("--in-flight", type=int, default=2,
                   help="layer units (one layer of one leaf) assembled/written at once; peak memory grows with it")
    p.add_argument("--chunk-mb", type=int, default=128, help="orbax storage chunk size bound in MiB")
    p.add_argument("--compress", action="store_true", help="zstd-compress orbax chunks (smaller, slower)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    from minimax_jax.config import ConfigError
    from minimax_jax.convert.atomic_dir import check_destination
    from minimax_jax.convert.errors import CheckpointError, DestinationError, DestinationExistsError

    if not os.path.isdir(args.src):
        what = "is not a directory" if os.path.exists(args.src) else "directory does not exist"
        print(f"error: --src {args.src}: {what}", file=sys.stderr)
        return 1
    try:
        check_destination(args.dst, sources=(args.src,), overwrite=args.overwrite)
    except DestinationExistsError:
        print(f"error: --dst {args.dst} already exists; pass --overwrite to replace it, or choose another --dst",
              file=sys.stderr)
        return 2
    except DestinationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.export:
            from minimax_jax.convert.export import export_orbax_to_hf

            out = export_orbax_to_hf(args.src, args.dst, fp8=args.fp8, overwrite=args.overwrite,
                                     max_shard_bytes=int(args.max_shard_gb * 1024 ** 3),
                                     progress=not args.no_progress, verify=not args.no_verify)
            print(f"wrote {out['tensors']} tensors ({out['bytes'] / 1e9:.3f} GB) in {out['shards']} shard(s) to {args.dst}")
        else:
            from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax

            cfg, rep = convert_hf_to_orbax(args.src, args.dst, args.dtype, overwrite=args.overwrite,
                                           progress=not args.no_progress, chunk_bytes=args.chunk_mb * 1024 ** 2,
                                           compress=args.compress, max_in_flight=args.in_flight)
            gb = rep["source_bytes"] / 1e9
            print(f"converted {rep['source_tensors']} tensors ({gb:.3f} GB) in {rep['seconds']:.1f} s "
                  f"({gb / max(rep['seconds'], 1e-9):.3f} GB/s) to {args.dst}")
    except DestinationError as e:   # the destination changed since the check above
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
