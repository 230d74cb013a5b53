"""End to end against HF transformers (MiniMax-M2): an HF directory converted on the fly, the paged
engine, a batch of two prompts of different lengths, 32 greedy tokens == HF ``generate``."""

import jax
import numpy as np

from minimax_jax.data.tokenizer import save_tokenizer
from minimax_jax.infer import GenerationConfig, Generator, load_model
from tests import hf_fixtures as hf
from tests import infer_helpers as H

jax.config.update("jax_default_matmul_precision", "highest")


def hf_greedy(model, prompt, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out.numpy()[0, len(prompt):].tolist()


def test_m2_hf_directory_paged_greedy_equals_hf_generate(tmp_path):
    hf.require_hf()
    model = hf.m2_model(seed=5, vocab=320)
    hf_dir = tmp_path / "hf"
    model.save_pretrained(str(hf_dir))
    save_tokenizer(H.tiny_tokenizer(), str(hf_dir))
    logs = []
    m = load_model(str(hf_dir), dtype="float32", log=logs.append)
    assert m.source == "hf (converted on the fly)" and any("converting" in s for s in logs)
    gen = Generator(m.cfg, m.params, m.tokenizer, log=logs.append)      # default engine: paged
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 320, 7).tolist(), rng.integers(3, 320, 19).tolist()]
    out = gen.generate(prompts, GenerationConfig(max_new_tokens=32, stop_token_ids=()))
    assert out.stats.engine.startswith("paged (DecodeEngine")
    for p, seq in zip(prompts, out.sequences):
        assert seq.stop_reason == "length"
        assert seq.tokens == hf_greedy(model, p, 32)
