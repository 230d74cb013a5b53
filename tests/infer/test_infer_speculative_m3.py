"""MTP speculative decoding on a random HF-derived MiniMax-M3 text model (MSA layers; the MTP layers
are MSA + MoE like M3's) with random MTP modules: greedy output == plain greedy, with a drafting
window shorter than the context so the MTP layers' sparse attention sees left padding."""

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.convert.from_state import params_from_hf_state
from minimax_jax.infer import GenerationConfig, Generator
from tests import hf_fixtures as hf
from tests import infer_helpers as H

jax.config.update("jax_default_matmul_precision", "highest")


def test_m3_random_mtp_speculative_greedy_equals_plain_greedy():
    hf.require_hf()
    model = hf.m3_model(seed=8)
    cfg = ModelConfig.from_hf_config(model.config.to_dict(), dtype="float32", param_dtype="float32",
                                     num_mtp_modules=2)
    assert cfg.layer_types[-1] == "msa"
    params = params_from_hf_state(hf.state_of(model), cfg.replace(num_mtp_modules=0))
    params["mtp"] = jax.tree.map(jnp.asarray, H.random_mtp(cfg, seed=8))
    prompt = [np.random.default_rng(8).integers(3, cfg.vocab_size, 16).tolist()]   # 16 + 10 + drafts < 32: one compile
    gen = Generator(cfg, params, engine="recompute")
    plain = gen.generate(prompt, GenerationConfig(max_new_tokens=10, stop_token_ids=()))
    spec = gen.generate(prompt, GenerationConfig(max_new_tokens=10, stop_token_ids=(), speculative="mtp",
                                                 mtp_window=12))
    assert spec.sequences[0].tokens == plain.sequences[0].tokens
    assert spec.stats.drafted > 0
