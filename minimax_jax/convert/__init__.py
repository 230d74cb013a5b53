"""Checkpoint conversion between published safetensors (BF16 / FP8 block-scaled) and orbax.

Public API (imported lazily so ``import minimax_jax.convert`` stays light):
- ``convert_hf_to_orbax(src, dst, dtype="bfloat16", ...) -> (cfg, report)``
- ``export_orbax_to_hf(src, dst, fp8=False, ...) -> summary``
- ``load_checkpoint(dir, cfg=None, mesh=None, rules=None, *, shardings=None, verify=True) -> (cfg, params)``
- every output carries ``minimax_manifest.json`` (a checksum per tensor, ``manifest``), checked on load;
  a destination overlapping its source, or existing and not written by us, is refused (``atomic_dir``).
- errors: ``CheckpointError`` and its subclasses (``ChecksumMismatch`` ...), ``DestinationError``
  in ``minimax_jax.convert.errors``.
CLI: ``python -m minimax_jax.convert --help``.
"""

from minimax_jax.convert.errors import (CheckpointError, ChecksumMismatch, CorruptFileError, DestinationError,
                                        MissingTensorError, TensorDtypeError, TensorShapeError, UnknownTensorError)

__all__ = ["convert_hf_to_orbax", "export_orbax_to_hf", "load_checkpoint", "CheckpointError", "CorruptFileError",
           "MissingTensorError", "TensorDtypeError", "TensorShapeError", "UnknownTensorError", "ChecksumMismatch",
           "DestinationError"]


def __getattr__(name):
    if name == "convert_hf_to_orbax":
        from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
        return convert_hf_to_orbax
    if name == "export_orbax_to_hf":
        from minimax_jax.convert.export import export_orbax_to_hf
        return export_orbax_to_hf
    if name == "load_checkpoint":
        from minimax_jax.convert.load import load_checkpoint
        return load_checkpoint
    raise AttributeError(f"module 'minimax_jax.convert' has no attribute {name!r}")
