"""Flax NNX wrapper around the pure forward function.

The module holds the params tree as ``nnx.Param`` leaves (each tagged with its logical axis names
in the variable metadata ``logical_axes``), so users get the NNX API (``nnx.split`` /
``nnx.merge`` / ``nnx.jit`` / ``nnx.state``), while ``forward`` stays a pure function of
``(params, config, inputs)`` that jit, grad and shard_map transform directly.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from minimax_jax.config import ModelConfig
from minimax_jax.model.params import init_params, param_axes
from minimax_jax.model.transformer import ModelOutput, forward, mtp_forward

__all__ = ["MiniMaxForCausalLM", "to_nnx_tree", "from_nnx_tree"]


def _is_axes(x):
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def to_nnx_tree(params: Any, axes: Any) -> Any:
    """Wrap every array leaf in ``nnx.Param`` carrying its logical axes; lists become ``nnx.List``."""
    if isinstance(params, dict):
        return nnx.Dict({k: to_nnx_tree(v, axes[k]) for k, v in params.items()})
    if isinstance(params, list):
        return nnx.List([to_nnx_tree(v, a) for v, a in zip(params, axes)])
    return nnx.Param(params, logical_axes=axes)


def from_nnx_tree(tree: Any) -> Any:
    """Inverse of ``to_nnx_tree``: plain nested dicts/lists of arrays."""
    if isinstance(tree, (dict, nnx.Dict)):
        return {k: from_nnx_tree(tree[k]) for k in tree.keys()} if isinstance(tree, dict) else \
            {k: from_nnx_tree(getattr(tree, k)) for k in vars(tree) if not k.startswith("_")}
    if isinstance(tree, (list, nnx.List)):
        return [from_nnx_tree(v) for v in tree]
    if isinstance(tree, nnx.Variable):
        return tree.get_value() if hasattr(tree, "get_value") else tree.value
    return tree


class MiniMaxForCausalLM(nnx.Module):
    """M2/M3 causal LM as an NNX module.

    Args:
      cfg: model config.
      rngs: ``nnx.Rngs`` (uses ``rngs.params()``) for random init; ignored when ``params`` is given.
      params: an existing params tree (e.g. restored from a checkpoint).
    Call: ``model(tokens [B,T] int32, positions=None, segment_ids=None, ...) -> ModelOutput``.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None, params: Any | None = None):
        self.cfg = cfg
        if params is None:
            if rngs is None:
                raise ValueError("MiniMaxForCausalLM needs rngs or params")
            params = init_params(cfg, rngs.params())
        self.params = to_nnx_tree(params, param_axes(cfg))

    def pure_params(self) -> Any:
        """The params as a plain pytree of arrays (what ``forward`` takes)."""
        return from_nnx_tree(self.params)

    def __call__(self, tokens: jax.Array, **kw) -> ModelOutput:
        return forward(self.pure_params(), self.cfg, tokens, **kw)

    def mtp(self, hidden: jax.Array, tokens: jax.Array, **kw) -> list[jax.Array]:
        """Per-depth MTP logits (see ``mtp_forward``)."""
        return mtp_forward(self.pure_params(), self.cfg, hidden, tokens, **kw)
