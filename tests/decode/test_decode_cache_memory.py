"""The paged engine sizes its KV cache before allocating it and refuses (``CacheTooLarge``) one larger than the
memory its devices have left; ``infer.py`` and the server turn that into one usage line naming the bytes and the
flag (exit 2), and the server refuses a ``--max_len`` past the model's context before loading anything."""

import jax
import numpy as np
import pytest

from minimax_jax.decode import engine as engine_mod
from minimax_jax.decode.cache import CacheSpec, available_memory, cache_device_bytes, init_cache
from minimax_jax.decode.engine import CacheTooLarge, DecodeEngine
from minimax_jax.model import abstract_params
from tests import infer_helpers as H

CONTEXT = 1 << 20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = H.tiny_tokenizer()
    cfg = H.tiny_config(tok.get_vocab_size(), max_position_embeddings=CONTEXT)
    params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_params(cfg))
    return H.save_checkpoint(str(tmp_path_factory.mktemp("mem") / "ckpt"), cfg, params, tok), cfg, params


@pytest.fixture
def little_memory(monkeypatch):
    monkeypatch.setattr(engine_mod, "available_memory", lambda device: (1 << 20, "test memory"))


def test_cache_bytes_are_those_allocated_and_memory_is_known_on_cpu(ckpt):
    _, cfg, _ = ckpt
    spec = CacheSpec(16, 9, 4, "float8_e4m3fn", "bfloat16", tuple(cfg.layer_types))
    assert cache_device_bytes(jax.eval_shape(lambda: init_cache(cfg, spec))) == sum(
        a.nbytes for a in jax.tree.leaves(init_cache(cfg, spec)))
    avail, what = available_memory(jax.devices("cpu")[0])
    assert avail > 0 and what == "available host memory"


def test_engine_refuses_before_allocating(ckpt, little_memory, monkeypatch):
    _, cfg, params = ckpt
    monkeypatch.setattr(engine_mod, "_new_cache", lambda *a: pytest.fail("allocated the cache"))
    with pytest.raises(CacheTooLarge) as e:
        DecodeEngine(params, cfg, max_seqs=2, max_len=CONTEXT)
    need = 2 * (2 * CONTEXT // 64 + 1) * 64 * cfg.head_dim * 4      # k and v: 2 slots of pages (+ the null page), f32
    assert e.value.needed == need and e.value.available == 1 << 20
    assert str(e.value).startswith(f"the paged KV cache for 2 sequence(s) of up to {CONTEXT:,} tokens needs {need:,} "
                                   "bytes (0.13 GiB)") and str(e.value).endswith("of test memory")


def test_infer_refuses_a_cache_larger_than_memory(ckpt, little_memory, capsys):
    from minimax_jax.infer import cli

    path = ckpt[0]
    rc = cli.main(["--checkpoint", path, "--prompt", "The weather", "--max_new_tokens", "1000000",
                   "--compilation_cache", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("infer.py: error: the paged KV cache for 1 sequence(s) of up to"), err
    assert "bytes" in err[-1] and "lower --max_new_tokens" in err[-1] and not any("Traceback" in x for x in err)


def test_server_checks_max_len_and_the_cache(ckpt, little_memory, capsys, monkeypatch):
    import minimax_jax.infer.loading as loading
    from minimax_jax.serve.cli import main

    path = ckpt[0]
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["--checkpoint", path, "--port", "0", "--max_len", "100000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--max_len 100000000 is longer than the model's context of {CONTEXT}" in err, err
    monkeypatch.setattr(loading, "load_model", real)
    assert main(["--checkpoint", path, "--port", "0", "--max_len", "65536", "--compilation_cache", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "the paged KV cache for 8 sequence(s) of up to 65,536 tokens" in err[-1], err
    assert err[-1].endswith("lower --max_len or --max_batch")
