"""MiniMax-M2 / M3 decoder: params pytree + pure forward functions + an NNX wrapper."""

from minimax_jax.model.nnx_model import MiniMaxForCausalLM
from minimax_jax.model.params import (abstract_params, add_index_params, count_params, init_params, layer_segments,
                                      layers_layout, param_axes, split_layers, stack_layers, unstack_layers)
from minimax_jax.model.shardings import params_shardings
from minimax_jax.model.transformer import ModelOutput, forward, mtp_forward

__all__ = ["MiniMaxForCausalLM", "ModelOutput", "abstract_params", "add_index_params", "count_params",
           "forward", "init_params", "layer_segments", "layers_layout", "mtp_forward", "param_axes", "params_shardings",
           "split_layers", "stack_layers", "unstack_layers"]
