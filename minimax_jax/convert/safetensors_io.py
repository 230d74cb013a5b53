"""Read safetensors checkpoints tensor by tensor with bounded memory.

Reading: the safetensors format is an 8-byte little-endian header length, a JSON header
(``name -> {dtype, shape, data_offsets}``, offsets relative to the end of the header), then the
raw little-endian data. We parse the header and read each tensor (or a range of its leading rows)
with positioned reads into a fresh numpy buffer, instead of memory-mapping whole shards: a mapped
shard's touched pages stay resident in this process, so peak RSS would grow with the shard size.
FP8 (``F8_E4M3``), BF16 and friends come back as ``ml_dtypes`` numpy arrays (``safetensors.numpy``
cannot return FP8). Writing uses ``safetensors.numpy.save_file`` (see ``export.py``).

Source of the format: https://github.com/huggingface/safetensors (README, "Format").
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable

import ml_dtypes
import numpy as np

from minimax_jax.convert.errors import CheckpointError, CorruptFileError, MissingTensorError

__all__ = ["TensorInfo", "SafetensorsReader", "DTYPES", "dtype_name", "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER = 512 * 1024 * 1024  # a header larger than this is corrupt, not real

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}


def dtype_name(dt) -> str:
    """safetensors dtype code (``"BF16"``...) of a numpy dtype; ValueError for unsupported ones."""
    dt = np.dtype(dt)
    for k, v in DTYPES.items():
        if v == dt:
            return k
    raise ValueError(f"no safetensors dtype code for numpy dtype {dt}")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives. ``offset`` is absolute in ``path``; ``nbytes`` its data length."""

    name: str
    path: str
    dtype: str          # safetensors code, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse one ``.safetensors`` file's header and check that every tensor's bytes lie inside the file.

    Raises: CorruptFileError naming the file (truncated, bad header, offsets out of range or
      inconsistent with shape x dtype).
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptFileError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > _MAX_HEADER or 8 + n > size:
                raise CorruptFileError(
                    f"{path}: truncated or corrupt safetensors file: header claims {n} bytes, file has {size}")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{path}: cannot read safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: safetensors header is not a JSON object")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptFileError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from e
        if dtype not in DTYPES:
            raise CorruptFileError(f"{path}: tensor {name!r} has unknown dtype code {dtype!r}")
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if b - a != want or a < 0:
            raise CorruptFileError(
                f"{path}: tensor {name!r} spans {b - a} bytes but shape {list(shape)} x {dtype} needs {want}")
        if base + b > size:
            raise CorruptFileError(
                f"{path}: truncated: tensor {name!r} ends at byte {base + b} but the file has {size} bytes")
        out[name] = TensorInfo(name, path, dtype, shape, base + a, b - a)
    return out


class SafetensorsReader:
    """All tensors of a checkpoint directory (sharded with ``model.safetensors.index.json``, or a single
    ``model.safetensors``, or any set of ``*.safetensors`` files), read on demand.

    ``infos`` maps name -> TensorInfo for every tensor in every shard. With an index file, every shard
    it names must exist and every tensor it lists must be in the shard it names.

    Raises: CheckpointError when no safetensors file is found; CorruptFileError for truncated shards
      or an index that disagrees with the shards.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        self.infos: dict[str, TensorInfo] = {}
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.exists(index):
            with open(index) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (KeyError, json.JSONDecodeError) as e:
                    raise CorruptFileError(f"{index}: not a safetensors index ({e})") from e
            files = sorted(set(weight_map.values()))
            for fn in files:
                p = os.path.join(self.directory, fn)
                if not os.path.exists(p):
                    raise CorruptFileError(f"{index} names shard {fn!r}, which does not exist")
                self._add(read_header(p))
            for name, fn in weight_map.items():
                info = self.infos.get(name)
                if info is None or os.path.basename(info.path) != fn:
                    raise CorruptFileError(f"{index} maps tensor {name!r} to {fn!r} but that shard does not hold it")
        else:
            files = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{self.directory}: no {INDEX_FILE} and no *.safetensors files")
            for fn in files:
                self._add(read_header(os.path.join(self.directory, fn)))

    def _add(self, infos: dict[str, TensorInfo]) -> None:
        for name, info in infos.items():
            if name in self.infos:
                raise CorruptFileError(f"tensor {name!r} appears in both {self.infos[name].path} and {info.path}")
            self.infos[name] = info

    # ------------------------------------------------------------------ queries
    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def names(self) -> Iterable[str]:
        return self.infos.keys()

    def info(self, name: str) -> TensorInfo:
        try:
            return self.infos[name]
        except KeyError:
            raise MissingTensorError(f"missing tensor {name!r}: not in any shard of {self.directory}") from None

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.infos.values())

    # ------------------------------------------------------------------ reads
    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor ``name`` (or rows ``rows`` of its first axis) in its stored dtype.

        Returns a fresh, writable numpy array (ml_dtypes for BF16/FP8), shape ``info.shape`` or
        ``(rows, *info.shape[1:])``.
        """
        info = self.info(name)
        shape, offset, nbytes = info.shape, info.offset, info.nbytes
        if rows is not None:
            if not shape:
                raise ValueError(f"cannot slice rows of scalar tensor {name!r}")
            start, stop, step = rows.indices(shape[0])
            if step != 1:
                raise ValueError("row slices must be contiguous")
            row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * info.np_dtype.itemsize
            shape = (max(stop - start, 0),) + shape[1:]
            offset, nbytes = offset + start * row_bytes, shape[0] * row_bytes
        out = np.empty(shape, info.np_dtype)
        buf = out.reshape(-1).view(np.uint8)
        with open(info.path, "rb", buffering=0) as f:
            f.seek(offset)
            got = f.readinto(buf) if nbytes else 0
        if got != nbytes:
            raise CorruptFileError(f"{info.path}: truncated: read {got} of {nbytes} bytes of tensor {name!r}")
        return out
