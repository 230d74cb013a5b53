"""The pieces of the warp-specialized Mosaic GPU weight gradient (``gpu_tgmm_ws``): config checks and the SMEM
ring one memory warpgroup fills and two compute warpgroups drain with ``wgmma``.

Ring protocol (one running slot counter per CTA across all its output tiles): step ``c`` uses slot ``c % stages``;
the memory warpgroup waits until both compute warpgroups released the slot's previous use (``consumed``, 2
arrivals) and issues the step's TMA loads on ``produced``; a compute warpgroup waits on ``produced``, issues its
``wgmma``, waits for the previous step's ``wgmma`` only (``wgmma_wait(1)``) and then releases that previous step's
slot, so one ``wgmma`` is always in flight; after a tile's last step it waits for all and releases the last slot.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = ["SMEM_BYTES", "MEMORY_REGISTERS", "COMPUTE_REGISTERS", "check_config", "over_tiles", "fill_steps",
           "drain_steps", "mma_steps"]

SMEM_BYTES = 227 * 1024          # Hopper: dynamic shared memory per CTA
MEMORY_REGISTERS = 40            # per thread of the memory warpgroup (JAX's Hopper matmul uses 40)
COMPUTE_REGISTERS = 232          # (512 - 40) / 2 rounded down to a multiple of 8


def check_config(cfg, choices: dict[str, tuple[int, ...]], smem_bytes: int) -> None:
    """Validate a frozen config dataclass in place: the ``choices`` fields are ints among their values (numpy
    ints accepted and converted), ``stages`` an int >= 2, ``num_sms`` None or an int >= 1, and ``smem_bytes`` (of
    the config, bf16) within ``SMEM_BYTES``. Raises ValueError naming the field."""
    name = type(cfg).__name__
    for field in (*choices, "stages"):
        v = getattr(cfg, field)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name}.{field} must be an int, got {v!r}")
        object.__setattr__(cfg, field, int(v))
    if cfg.num_sms is not None:
        if isinstance(cfg.num_sms, bool) or not isinstance(cfg.num_sms, (int, np.integer)) or cfg.num_sms < 1:
            raise ValueError(f"{name}.num_sms must be None or an int >= 1, got {cfg.num_sms!r}")
        object.__setattr__(cfg, "num_sms", int(cfg.num_sms))
    for field, allowed in choices.items():
        if getattr(cfg, field) not in allowed:
            raise ValueError(f"{name}.{field} must be " + " or ".join(map(str, allowed))
                             + f", got {getattr(cfg, field)!r}")
    if cfg.stages < 2:
        raise ValueError(f"{name}.stages must be an int >= 2, got {cfg.stages!r}")
    if smem_bytes > SMEM_BYTES:
        raise ValueError(f"{name} {cfg.label()} needs {smem_bytes // 1024} KiB of shared memory "
                         f"(> {SMEM_BYTES // 1024} KiB on Hopper): fewer stages or smaller blocks")


def over_tiles(num_tiles: int, decode):
    """Decorator: run ``per_tile(*decode(t), count) -> count`` over this CTA's share of the ``num_tiles`` output
    tiles in order (``plgpu.nd_loop`` over the SMs), the ring's slot counter as the carry (from 0); the
    decorated name becomes the final count."""
    def deco(per_tile):
        @plgpu.nd_loop((num_tiles,), collective_axes="sm", init_carry=jnp.int32(0))
        def run(info, carry):
            return per_tile(*decode(info.index[0]), carry)
        return run
    return deco


def fill_steps(produced, consumed, stages: int, nsteps, carry, load):
    """Memory warpgroup: ``nsteps`` ring steps from slot counter ``carry``; ``load(step, slot, barrier)`` issues
    the step's TMA copies on ``barrier``. Returns the counter after them."""
    def step(s, c):
        slot = lax.rem(c, stages)

        @pl.when(c >= stages)
        def _():
            plgpu.barrier_wait(consumed.at[slot])        # both compute warpgroups released it
        load(s, slot, produced.at[slot])
        return c + 1
    return lax.fori_loop(0, nsteps, step, carry)


def drain_steps(consumed, stages: int, used) -> None:
    """Memory warpgroup, at the end: observe the last release of each slot before the barriers go away."""
    def drain(j, carry):
        plgpu.barrier_wait(consumed.at[lax.rem(j, stages)])
        return carry
    lax.fori_loop(jnp.maximum(used - stages, 0), used, drain, None)


def mma_steps(produced, consumed, stages: int, nsteps, carry, mma):
    """Compute warpgroup: ``nsteps`` ring steps from slot counter ``carry``; ``mma(step, slot)`` issues the
    step's ``wgmma``. Releases every slot it used (the last after all its ``wgmma`` finished); returns the
    counter after them."""
    def step(s, c):
        slot = lax.rem(c, stages)
        plgpu.barrier_wait(produced.at[slot])
        mma(s, slot)
        plgpu.wgmma_wait(1)                                # the previous step's wgmma is done

        @pl.when(s > 0)
        def _():
            plgpu.barrier_arrive(consumed.at[lax.rem(c + (stages - 1), stages)])
        return c + 1
    c_end = lax.fori_loop(0, nsteps, step, carry)
    plgpu.wgmma_wait(0)

    @pl.when(nsteps > 0)
    def _():
        plgpu.barrier_arrive(consumed.at[lax.rem(c_end + (stages - 1), stages)])
    return c_end
