"""One registry of implementations for every op, one dispatch function, and the report of what ran.

Every op (``attention``, ``msa_attention``, ``moe_experts``, ``paged_attention``, ...) registers its
implementations here once, in the module that defines the op: a name, the function, the platforms it
runs on and a ``supports`` check. ``dispatch`` is the only place that picks one:
- an explicit name runs that implementation, or raises ``ImplementationUnavailable`` naming why not
  (unknown name, wrong platform, or the reason its ``supports`` returned): nothing falls back silently;
- ``"auto"`` walks the op's preference list for the current platform (``Op.auto``) and runs the first
  implementation whose platform matches and whose ``supports`` accepts the call; the reasons of the
  ones passed over are recorded under ``"<op>.auto_reason"``.
What ran is recorded under the op's name at trace time (``implementation_report``): recording happens
in Python when the choice is made and costs nothing at run time.

Naming, the same for every op: ``xla`` (the plain-JAX reference) and ``xla_<variant>`` (other plain-JAX
algorithms), ``<family>_<platform>`` for a kernel family on one platform (``pallas_gpu``,
``pallas_flash_tpu``, ``cudnn``, ``tokamax``), ``<family>_<platform>_interpret`` for the same kernels in
Pallas' interpreter (any platform; CPU tests), and ``auto``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Sequence

import jax

from pallas_kernels.common import triton_cuda_target

__all__ = ["ImplementationUnavailable", "Implementation", "Op", "register", "get_op", "implementation_names",
           "dispatch", "resolve", "record_implementation", "refine_implementation", "implementation_report",
           "clear_implementation_report", "default_backend", "assume_backend", "PLATFORMS"]

#: The platforms ``default_backend()`` can return.
PLATFORMS = ("cpu", "gpu", "tpu")


class ImplementationUnavailable(RuntimeError):
    """Raised when an explicitly requested implementation cannot run here (the message says why)."""


# ----------------------------------------------------------------------------- the report of what ran
_lock = threading.Lock()
_report: dict[str, list[str]] = {}     # op -> distinct values, in the order first recorded


_dispatching = threading.local()        # .stack: [(op, the value its dispatch recorded, whether it was new)]


def record_implementation(op: str, implementation: str) -> bool:
    """Record that ``op`` (e.g. ``"msa_attention"``) resolved to ``implementation`` at trace time.

    The report keeps every distinct value recorded under ``op`` since it was last cleared, in the order
    first seen: a program whose layers run one op two ways (an MoE layer's two grouped matmuls, MTP
    layers on another attention path) reports both, never only the last. Returns whether the value was new."""
    with _lock:
        seen = _report.setdefault(op, [])
        if implementation in seen:
            return False
        seen.append(implementation)
        return True


def refine_implementation(op: str, detail: str) -> None:
    """Inside ``op``'s implementation (called by ``dispatch``): report ``detail`` (e.g. ``"expert_parallel[...]"``)
    in place of the plain implementation name that this call's dispatch recorded, unless an earlier call had
    recorded that name too (then both stay). Outside a dispatch of ``op`` it records ``detail``."""
    frame = next((f for f in reversed(getattr(_dispatching, "stack", [])) if f[0] == op), None)
    if frame is not None and frame[2]:
        with _lock:
            seen = _report.get(op, [])
            if frame[1] in seen:
                seen.remove(frame[1])
    record_implementation(op, detail)


def implementation_report() -> dict[str, str]:
    """Return ``{op name: implementation}`` for every op traced since the report was last cleared; an op
    recorded with several distinct values gets them ``"; "``-joined in the order first seen."""
    with _lock:
        return {op: "; ".join(values) for op, values in _report.items()}


def clear_implementation_report() -> None:
    """Forget what was recorded (tests use this to check a specific trace)."""
    with _lock:
        _report.clear()


# ----------------------------------------------------------------------------- the platform
_assumed_backend: list[str] = []


def default_backend() -> str:
    """The default JAX backend: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (or the one ``assume_backend`` sets)."""
    return _assumed_backend[-1] if _assumed_backend else jax.default_backend()


@contextlib.contextmanager
def assume_backend(backend: str):
    """Within the block, ``default_backend()`` returns ``backend``: ops' ``"auto"`` choices resolve as
    they would on that backend, so a CPU machine can trace a step as the GPU will run it and lower it
    with ``.lower(lowering_platforms=("cuda",))`` (bench/train_step.py ``--lower-for cuda``). Only
    for tracing and lowering: nothing traced inside can run on this machine. Not thread-safe."""
    if backend not in PLATFORMS:
        raise ValueError(f"assume_backend: expected cpu, gpu or tpu, got {backend!r}")
    _assumed_backend.append(backend)
    try:
        with (triton_cuda_target() if backend == "gpu" else contextlib.nullcontext()):
            yield
    finally:
        _assumed_backend.pop()


# ----------------------------------------------------------------------------- implementations
Supports = Callable[..., "str | None"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to run an op.

    name: the ``implementation=`` name (module docstring's scheme).
    fn: called with the op's (validated) arguments, exactly as ``dispatch`` receives them.
    platforms: the platforms it runs on; None = any (plain JAX, interpreters).
    supports: ``supports(*args, **kwargs) -> None | reason``: None when it can serve this call; the reason
      (one line) otherwise. None = serves every call its platform check lets through.
    """

    name: str
    fn: Callable[..., Any]
    platforms: tuple[str, ...] | None = None
    supports: Supports | None = None

    def unavailable(self, backend: str, args: tuple, kwargs: dict) -> str | None:
        """None when this implementation serves the call on ``backend``, else why not."""
        if self.platforms is not None and backend not in self.platforms:
            return f"needs a {' or '.join(p.upper() for p in self.platforms)} backend, not {backend!r}"
        return None if self.supports is None else self.supports(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Op:
    """An op's implementations and its ``"auto"`` policy.

    auto: ``auto(backend, *args, **kwargs) -> names`` in preference order for this call; the first that
      serves the call runs. Its last name should serve every call (the XLA reference), else ``"auto"``
      raises ImplementationUnavailable listing every reason.
    """

    name: str
    implementations: dict[str, Implementation]
    auto: Callable[..., Sequence[str]]

    @property
    def names(self) -> tuple[str, ...]:
        return ("auto", *self.implementations)


_ops: dict[str, Op] = {}


def register(name: str, implementations: Sequence[Implementation], auto: Callable[..., Sequence[str]]) -> Op:
    """Register op ``name`` (once, at import of the module that defines the op). Returns the Op.

    Raises ValueError for a second registration of the same op or two implementations of one name;
    TypeError when ``auto`` is not callable.
    """
    if not callable(auto):
        raise TypeError(f"{name}: auto must be callable (backend, *args, **kwargs) -> names, got {auto!r}")
    table = {}
    for impl in implementations:
        if impl.name in table or impl.name == "auto":
            raise ValueError(f"{name}: implementation name {impl.name!r} registered twice or reserved")
        table[impl.name] = impl
    if name in _ops:
        raise ValueError(f"op {name!r} is registered already")
    op = Op(name, table, auto)
    _ops[name] = op
    return op


def get_op(name: str) -> Op:
    """The registered op ``name``. Raises KeyError naming the registered ops."""
    try:
        return _ops[name]
    except KeyError:
        raise KeyError(f"no op {name!r} registered; registered: {sorted(_ops)}") from None


def implementation_names(op: str) -> tuple[str, ...]:
    """Every ``implementation=`` name ``op`` accepts, ``"auto"`` first."""
    return get_op(op).names


def _pick(op: str, implementation: str, args: tuple, kwargs: dict) -> tuple[Implementation, list[str]]:
    """(the implementation to run, the reasons of the ``"auto"`` candidates passed over)."""
    o = get_op(op)
    backend = default_backend()
    if implementation == "auto":
        reasons = []
        for name in o.auto(backend, *args, **kwargs):
            impl = o.implementations.get(name)
            if impl is None:
                raise ValueError(f"{op}: its auto policy named {name!r}, which is not registered; "
                                 f"registered: {'|'.join(o.implementations)}")
            reason = impl.unavailable(backend, args, kwargs)
            if reason is None:
                return impl, reasons
            reasons.append(f"{name}: {reason}")
        raise ImplementationUnavailable(f"{op}: no implementation serves this call on {backend}: " + "; ".join(reasons))
    impl = o.implementations.get(implementation)
    if impl is None:
        raise ImplementationUnavailable(
            f"{op}: unknown implementation {implementation!r}; expected one of {'|'.join(o.names)}")
    reason = impl.unavailable(backend, args, kwargs)
    if reason is not None:
        raise ImplementationUnavailable(f"{op}: implementation {implementation!r} cannot serve this call: {reason}")
    return impl, []


def resolve(op: str, implementation: str, *args, **kwargs) -> Implementation:
    """The implementation ``dispatch`` would run for this call (records nothing).

    Raises ImplementationUnavailable for an unknown name, an explicit implementation that cannot serve
    the call, or an ``"auto"`` list none of whose entries can; ValueError when the op's ``auto`` names
    an implementation that is not registered (a registration bug).
    """
    return _pick(op, implementation, args, kwargs)[0]


def dispatch(op: str, implementation: str, *args, **kwargs):
    """Run ``op`` with ``implementation`` (a name or ``"auto"``) on the call's arguments; record what ran
    under ``op`` (and, for ``"auto"``, the reasons of the candidates passed over under ``"<op>.auto_reason"``).

    Raises ImplementationUnavailable as ``resolve`` does.
    """
    impl, reasons = _pick(op, implementation, args, kwargs)
    if reasons:
        record_implementation(f"{op}.auto_reason", "; ".join(reasons))
    stack = _dispatching.__dict__.setdefault("stack", [])
    stack.append((op, impl.name, record_implementation(op, impl.name)))
    try:
        return impl.fn(*args, **kwargs)
    finally:
        stack.pop()
