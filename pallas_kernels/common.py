"""JAX helpers the kernels share (the leaf under every other layer: imports only jax).

- ``searchsorted``: binary search without an XLA while loop (work lists of the grouped matmuls and
  the MSA layouts).
- shard_map typing: ``typed_out_struct``, ``varying_axes``, ``VmaType`` / ``vma_type``, ``match_vma``,
  ``match_cotangent`` (kernel outputs and custom-VJP cotangents typed like their operands).
- ``triton_cuda_target``: lower Pallas Triton kernels for CUDA on a machine without a GPU.
- 1-byte arrays in Pallas Triton kernels: ``needs_byte_pairs`` / ``to_byte_pairs`` (XLA side) and
  ``from_byte_pairs`` (kernel side): Triton element offsets stay below 2**31 for 2**31 - 2**32 elements.
- Mosaic GPU (Hopper) helpers: ``mosaic_interpreter_available`` / ``mosaic_interpreter_pool_reason`` /
  ``mosaic_interpret_params`` (the Mosaic GPU interpreter of jax >= 0.11), ``mosaic_smem_transforms`` (tiling + swizzle of a ``wgmma`` /
  TMA operand), ``mosaic_load_rows`` (an SMEM vector in a ``wgmma`` accumulator's row layout),
  ``gpu_compute_capability`` (of the first visible GPU).
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp

__all__ = ["gqa_triton_reason", "searchsorted", "typed_out_struct", "triton_cuda_target", "varying_axes", "VmaType",
           "vma_type", "match_vma", "match_cotangent", "mosaic_interpreter_available", "mosaic_interpreter_pool_reason",
           "mosaic_interpret_params",
           "mosaic_smem_transforms", "mosaic_load_rows", "gpu_compute_capability", "needs_byte_pairs", "to_byte_pairs",
           "from_byte_pairs"]


def gqa_triton_reason(q, k, v) -> str | None:
    """Why q ``[B, T, H, D]`` and k / v ``[B, S, G, D]`` (arrays or ShapeDtypeStructs) do not fit the
    Triton GQA attention kernels (rank, shapes, heads, a power-of-two head dim in [16, 256], one dtype of
    float32 / bfloat16 / float16); None when they do."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return f"q, k, v must be rank 4, got {q.shape}, {k.shape}, {v.shape}"
    bsz, _, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != bsz or k.shape[3] != d:
        return f"k {k.shape} / v {v.shape} do not match q {q.shape} as [B, S, G, D]"
    if k.shape[2] < 1 or h % k.shape[2]:
        return f"{h} query heads are not a multiple of {k.shape[2]} kv heads"
    if d < 16 or d & (d - 1) or d > 256:
        return f"head_dim must be a power of two in [16, 256] (Triton tiles), got {d}"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"q/k/v must share one dtype of float32/bfloat16/float16, got {q.dtype}/{k.dtype}/{v.dtype}"
    return None


def needs_byte_pairs(x) -> bool:
    """True when a Pallas Triton kernel must read ``x`` as uint16 byte pairs (``to_byte_pairs``): jax's Triton
    lowering computes element offsets in int32 for arrays of at most 2**32 bytes, so a 1-byte array (FP8 weights,
    FP8 caches) of 2**31 to 2**32 elements overflows them (wrong values or an illegal address on the GPU; seen
    with M2's FP8 gate / up weights, 256 x 3072 x 3072). Above 2**32 bytes jax switches to 64-bit offsets."""
    return jnp.dtype(x.dtype).itemsize == 1 and 2 ** 31 <= x.size <= 2 ** 32


def to_byte_pairs(x: jax.Array) -> jax.Array:
    """A 1-byte array ``[..., N]`` (N even) as uint16 ``[..., N/2]`` (element offsets halve). An XLA bitcast, no
    copy on the GPU (timed with M2's FP8 experts: BENCHMARKS.md, MoE grouped matmul)."""
    if jnp.dtype(x.dtype).itemsize != 1 or x.shape[-1] % 2:
        raise ValueError(f"to_byte_pairs: need a 1-byte dtype and an even last dim, got {x.dtype} {x.shape}")
    return jax.lax.bitcast_convert_type(x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2)), jnp.uint16)


def from_byte_pairs(tile: jax.Array, dtype) -> jax.Array:
    """Inside a kernel: a loaded uint16 tile ``[R, n/2]`` of ``to_byte_pairs`` -> the ``[R, n]`` tile of 1-byte
    ``dtype`` (little endian: the low byte is the even column; the byte planes are interleaved by a join)."""
    lo = (tile & 0xFF).astype(jnp.uint8)
    hi = jax.lax.shift_right_logical(tile, jnp.uint16(8)).astype(jnp.uint8)
    r, half = tile.shape
    both = jax.lax.concatenate([lo.reshape(r, half, 1), hi.reshape(r, half, 1)], 2)
    return jax.lax.bitcast_convert_type(both.reshape(r, 2 * half), dtype)


def searchsorted(sorted_values: jax.Array, queries: jax.Array, side: str = "left") -> jax.Array:
    """``jnp.searchsorted`` without an XLA while loop: int32 insertion indices, ``queries.shape``.

    Args: ``sorted_values`` 1-D, ascending; ``queries`` any shape, same dtype kind; ``side`` "left" /
      "right" (as numpy). Raises ValueError for another side (from jnp.searchsorted).
    Why: the default method ("scan") lowers to an XLA ``while`` loop, which a GPU runs with a host round
    trip per iteration (measured in BENCHMARKS.md, MoE). ``"scan_unrolled"`` is the same binary search
    unrolled, log2(len) fused steps.
    """
    return jnp.searchsorted(sorted_values, queries, side=side, method="scan_unrolled").astype(jnp.int32)


def typed_out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A kernel's output type (``pallas_call`` out_shape / ``plgpu.kernel`` out_type): typed like ``like``
    inside ``shard_map`` (with check_vma=True a kernel's output needs ``manual_axis_type``), a plain
    ``ShapeDtypeStruct(shape, dtype)`` elsewhere."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    if mat is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


@contextlib.contextmanager
def triton_cuda_target(gpu: str | None = None):
    """Within the block, Pallas Triton kernels lower for CUDA on a machine without a GPU, for ``gpu``
    (a ``GpuVersion`` name of jax's ``gpu_info``; default: the first one of compute capability 9.0,
    Hopper, the architecture our kernels are tuned for). jax >= 0.11 asks the local GPU for its compute
    capability and raises "No supported GPU devices found" without one (jax 0.10 lowered without asking). A machine with a GPU keeps its own answer;
    where jax has no such module this is a no-op. Entered by ``assume_backend("gpu")``. Raises ValueError
    for a ``gpu`` jax does not know. Exit nested blocks in reverse order (a ``with`` statement does).
    Why a private jax module: jax's public way, an abstract mesh with an ``AbstractDevice``, would replace
    the (concrete) mesh the caller traces under. Not thread-safe.
    """
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        gpu_info = None
    if gpu_info is None or not hasattr(gpu_info, "get_gpu_info_from_version"):
        yield
        return
    try:
        version = _hopper(gpu_info) if gpu is None else gpu_info.GpuVersion[gpu]
    except KeyError:
        raise ValueError(f"triton_cuda_target: unknown GPU {gpu!r}; one of "
                         f"{[v.name for v in gpu_info.GpuVersion]}") from None
    local = gpu_info.get_gpu_info

    def get_gpu_info():
        try:
            return local()
        except ValueError:
            # Only where no GPU is visible and no abstract GPU device is set (jax 0.10's situation): a GPU
            # or an abstract GPU target jax cannot map keeps jax's error. (Inside a mesh of CPU devices the
            # abstract device is a CPU: that is the no-GPU case.)
            target = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
            if _gpu_visible() or getattr(target, "platform", None) == "gpu":
                raise
            return gpu_info.get_gpu_info_from_version(version)
    get_gpu_info.__wrapped_local__ = local      # jax's own lookup (tests)
    gpu_info.get_gpu_info = get_gpu_info
    try:
        yield
    finally:
        gpu_info.get_gpu_info = local


def _hopper(gpu_info):
    """The first ``GpuVersion`` of compute capability 90 (sm_90)."""
    for v in gpu_info.GpuVersion:
        try:
            if gpu_info.get_gpu_info_from_version(v).compute_capability == 90:
                return v
        except ValueError:
            continue
    raise KeyError("sm_90")


def _gpu_visible() -> bool:
    try:
        return bool(jax.local_devices(backend="gpu"))
    except RuntimeError:
        return False


# ----------------------------------------------------------------------------- Mosaic GPU (Hopper)

def _plgpu():
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


def mosaic_interpreter_available() -> bool:
    """Whether this jax has the Mosaic GPU interpreter (``plgpu.InterpretGPUParams``, jax >= 0.11)."""
    return getattr(_plgpu(), "InterpretGPUParams", None) is not None


def _cpu_executions() -> int:
    """How many XLA CPU executions run at once: the CPU client's pool, ``PJRT_NPROC`` or ``NPROC`` (read
    by XLA in that order), else the usable cores."""
    for name in ("PJRT_NPROC", "NPROC"):
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            pass
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def mosaic_interpreter_pool_reason(warpgroups: int = 3) -> str | None:
    """Why the Mosaic GPU interpreter could deadlock here (None when it cannot): it runs a CTA's
    ``warpgroups`` as concurrent XLA CPU executions that wait on each other's barriers, inside the
    kernel call's own execution, so the CPU client must run ``warpgroups + 1`` at once."""
    n = _cpu_executions()
    if n >= warpgroups + 1:
        return None
    return (f"the Mosaic GPU interpreter needs {warpgroups + 1} concurrent XLA CPU executions and this process "
            f"allows {n}: set NPROC={warpgroups + 1} (or more) in the environment before JAX starts")


def mosaic_interpret_params(kernel: str, warpgroups: int = 3):
    """``plgpu.InterpretGPUParams()`` for running ``kernel`` (a name for the error) in the interpreter.

    Raises NotImplementedError on a jax without the interpreter (jax < 0.11); RuntimeError when the
    CPU client's pool could deadlock it (``mosaic_interpreter_pool_reason``; set ``NPROC`` before JAX
    starts; tests/conftest.py does)."""
    if not mosaic_interpreter_available():
        raise NotImplementedError(f"{kernel}(interpret=True) needs the Mosaic GPU interpreter of jax >= 0.11 "
                                  f"(this is jax {jax.__version__})")
    why = mosaic_interpreter_pool_reason(warpgroups)
    if why is not None:
        raise RuntimeError(f"{kernel}(interpret=True): {why}")
    return _plgpu().InterpretGPUParams()


def mosaic_smem_transforms(minor: int, itemsize: int):
    """8-row tiling and the widest swizzle for an SMEM operand whose minor dimension holds ``minor``
    elements of ``itemsize`` bytes (``wgmma`` operands and their TMA copies)."""
    plgpu = _plgpu()
    swizzle = plgpu.find_swizzle(minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def mosaic_load_rows(ref, axis: int = 1):
    """A 1-D SMEM vector loaded in the row layout of a ``wgmma`` accumulator (one value per row; with
    ``axis=0`` the column layout: one value per column)."""
    plgpu = _plgpu()
    layout = plgpu.Layout.WGMMA.reduce(axis)
    try:
        return plgpu.load(ref, layout=layout)
    except TypeError:                       # jax 0.10 takes an index argument
        return plgpu.load(ref, (), layout=layout)


def gpu_sm_count(default: int = 132) -> int:
    """SM count of the first device (``core_count``), ``default`` where it reports none (no GPU visible, e.g.
    lowering on a CPU machine for a Hopper target: 132 SMs)."""
    return int(getattr(jax.devices()[0], "core_count", None) or default)


def gpu_compute_capability() -> str | None:
    """Compute capability of the first visible GPU (``"9.0"`` on Hopper), None without a GPU."""
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:
        return None
    return getattr(devices[0], "compute_capability", None) if devices else None


# ----------------------------------------------------------------------------- shard_map typing
# Inside ``shard_map`` (with ``check_vma=True``, the default) every value carries the set of manual
# mesh axes it varies over ("vma"). Where JAX keeps that set:
# - jax 0.6 - 0.9: ``jax.typeof(x).vma`` (a frozenset);
# - jax >= 0.10 (0.10.2 on the CPU machines, 0.11.x on the GPU machine): ``.vma`` was removed (0.10.0 changelog); the set
#   is ``jax.typeof(x).manual_axis_type.varying`` (``manual_axis_type`` is a ``ManualAxisType`` with
#   ``varying`` / ``unreduced`` / ``reduced``; printed as ``f32[8,4]{V:expert}``).
# Casting to varying: ``jax.lax.pcast(x, axes, to="varying")`` (``jax.lax.pvary`` before it, removed
# in 0.10.0). Outside ``shard_map`` every value varies over nothing and all of this is the identity.


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty outside; any JAX value).

    Raises RuntimeError when this JAX exposes neither ``manual_axis_type.varying`` (jax >= 0.10) nor
    ``.vma`` (jax 0.6 - 0.9) on the value's type: guessing "invariant" there would make the
    casts below silent no-ops (jax 0.11.2 has no ``.vma``).
    """
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    vma = getattr(t, "vma", None)
    if vma is not None:
        return frozenset(vma)
    raise RuntimeError(
        f"cannot read the varying manual axes of a {type(t).__name__} ({t}) in jax {jax.__version__}: "
        "neither jax.typeof(x).manual_axis_type.varying (jax >= 0.10) nor jax.typeof(x).vma (jax 0.6-0.9) exists")


def _cast_varying(x: jax.Array, axes: tuple) -> jax.Array:
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    if hasattr(jax.lax, "pvary"):
        return jax.lax.pvary(x, axes)
    raise RuntimeError(f"jax {jax.__version__} has neither jax.lax.pcast nor jax.lax.pvary")


class VmaType:
    """The varying axes of a value, as a leafless pytree (a static custom-VJP residual).

    ``vma_type(x)`` in a custom VJP's forward rule carries the primal's type to its backward rule,
    where ``match_cotangent(ct, that)`` casts the cotangent to it, without keeping ``x`` alive.
    """

    __slots__ = ("axes",)

    def __init__(self, axes):
        self.axes = frozenset(axes)

    def __eq__(self, other):
        return isinstance(other, VmaType) and other.axes == self.axes

    def __hash__(self):
        return hash(self.axes)

    def __repr__(self):
        return f"VmaType({sorted(self.axes)})"


jax.tree_util.register_pytree_node(VmaType, lambda t: ((), t.axes), lambda axes, _: VmaType(axes))


def vma_type(x) -> VmaType:
    """``VmaType(varying_axes(x))`` (see ``VmaType``)."""
    return VmaType(varying_axes(x))


def _axes_of(like) -> frozenset:
    return like.axes if isinstance(like, VmaType) else varying_axes(like)


def match_vma(x: jax.Array, like) -> jax.Array:
    """Mark ``x`` as varying over the manual mesh axes that ``like`` varies over (``shard_map`` typing).

    ``like``: an array or a ``VmaType``. Values made from scratch (``jnp.zeros``, e.g. the receive
    buffer of ``ragged_all_to_all``, whose output takes the buffer's type) or returned by kernels
    that do not propagate the type (a ``pallas_call``, e.g. tokamax's grouped matmul) come out
    invariant, and a custom VJP whose cotangent is varying then fails JAX's type check. Only adds
    axes (``jax.lax.pcast(..., to="varying")``, transposed to a ``psum`` by autodiff); axes ``x``
    varies over and ``like`` does not stay. Outside ``shard_map`` this is the identity.
    Caveat: this retypes, it does not fix values. A value typed invariant whose data really differs
    per rank (a kernel that drops the type) gets, through the transposed cast, the SUM of the
    ranks' cotangents: right over size-1 axes (one GPU), wrong over larger ones. Kernels must type
    their outputs (``pallas_kernels.moe.gpu_gmm`` does, through ``out_shape``).
    Raises RuntimeError where the varying axes cannot be read (``varying_axes``).
    """
    missing = tuple(sorted(_axes_of(like) - varying_axes(x)))
    return _cast_varying(x, missing) if missing else x


def common_vma(*xs):
    """Every array cast to vary over the union of the arrays' varying axes (``match_vma``): the operands of a
    kernel with a custom VJP, so its cotangents are typed like its primals inside ``shard_map``."""
    like = VmaType(frozenset().union(*(varying_axes(x) for x in xs)))
    return tuple(match_vma(x, like) for x in xs)


def match_cotangent(ct, primal):
    """Cast a custom-VJP cotangent to its primal input's varying type (``primal``: array or ``VmaType``).

    JAX requires a custom VJP's backward rule to return cotangents typed exactly like the primal
    inputs. Axes the primal varies over and the cotangent does not are added (``pcast`` to
    varying); axes the cotangent varies over and the primal does not are summed over (``psum``):
    a primal invariant over an axis is the same value on every rank, its cotangent is the sum of
    the ranks' contributions (what autodiff gives through the implicit cast of an invariant operand
    meeting a varying one). ``None`` (no cotangent) passes through; identity outside ``shard_map``.
    """
    if ct is None:
        return None
    want, have = _axes_of(primal), varying_axes(ct)
    extra = tuple(sorted(have - want))
    if extra:
        ct = jax.lax.psum(ct, extra)
    missing = tuple(sorted(want - have))
    return _cast_varying(ct, missing) if missing else ct
