"""End to end against HF transformers (MiniMax-M3 text, MSA layers with pages == index blocks):
HF checkpoint -> ``minimax_jax.convert`` -> our orbax directory -> paged engine; 32 greedy tokens
== HF ``generate``, with prompts long enough that block selection is sparse."""

import jax
import numpy as np

from minimax_jax.convert import convert_hf_to_orbax
from minimax_jax.data.tokenizer import save_tokenizer
from minimax_jax.infer import GenerationConfig, Generator, load_model
from tests import hf_fixtures as hf
from tests import infer_helpers as H
from tests.infer.test_infer_parity_m2 import hf_greedy

jax.config.update("jax_default_matmul_precision", "highest")


def test_m3_converted_checkpoint_paged_greedy_equals_hf_generate(tmp_path):
    hf.require_hf()
    model = hf.m3_model(seed=6, vocab=320)
    hf_dir, ours = tmp_path / "hf", tmp_path / "ours"
    model.save_pretrained(str(hf_dir))
    save_tokenizer(H.tiny_tokenizer(), str(hf_dir))
    convert_hf_to_orbax(str(hf_dir), str(ours), "float32", progress=False)
    m = load_model(str(ours))
    assert m.source == "orbax" and m.cfg.has_msa
    gen = Generator(m.cfg, m.params, m.tokenizer)
    rng = np.random.default_rng(6)
    # block 8, top-3 blocks: 30 + 32 tokens span 8 blocks, so selection really drops blocks
    prompts = [rng.integers(3, 320, 30).tolist(), rng.integers(3, 320, 11).tolist()]
    out = gen.generate(prompts, GenerationConfig(max_new_tokens=32, stop_token_ids=()))
    assert out.stats.engine.startswith("paged (DecodeEngine: page_size=8")
    for p, seq in zip(prompts, out.sequences):
        assert seq.tokens == hf_greedy(model, p, 32)
