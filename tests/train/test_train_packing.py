"""Packed documents never see each other: changing document A of a row changes nothing of document
B's logits (main and MTP heads), for dense attention and for MSA (whose blocks restart per document)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.model import forward, init_params, mtp_forward
from minimax_jax.train.config import from_dict
from minimax_jax.train.model_init import model_configs
from tests.train_helpers import MICRO_MODEL, MICRO_MSA_MODEL, micro_train_dict


def _row(cfg, doc_a, doc_b):
    toks = np.concatenate([doc_a, doc_b])[None].astype(np.int32)
    seg = np.concatenate([np.full(len(doc_a), 1), np.full(len(doc_b), 2)])[None].astype(np.int32)
    pos = np.concatenate([np.arange(len(doc_a)), np.arange(len(doc_b))])[None].astype(np.int32)
    return jnp.asarray(toks), jnp.asarray(seg), jnp.asarray(pos)


@pytest.mark.parametrize("model", ["dense", "msa"])
def test_packed_documents_are_isolated(tmp_path, model):
    """Changing document A changes nothing of document B's logits (main and MTP) in the same row."""
    tc = from_dict(micro_train_dict(str(tmp_path), model=MICRO_MODEL if model == "dense" else MICRO_MSA_MODEL))
    cfg, _ = model_configs(tc)
    params = init_params(cfg, jax.random.key(1))
    kl = "sparse" if cfg.has_msa else None

    @jax.jit
    def run(toks, seg, pos):
        out = forward(params, cfg, toks, positions=pos, segment_ids=seg, indexer_kl=kl, return_hidden=True)
        mtp = mtp_forward(params, cfg, out.hidden, toks, positions=pos, segment_ids=seg)
        return out.logits, mtp, out.aux["indexer_kl_sum"]

    rng = np.random.default_rng(0)
    la, lb = 21, 51  # B spans 7 blocks of 8 > top-2: MSA really selects
    doc_b = rng.integers(0, cfg.vocab_size, lb)
    base = run(*_row(cfg, rng.integers(0, cfg.vocab_size, la), doc_b))
    other = run(*_row(cfg, rng.integers(0, cfg.vocab_size, la), doc_b))
    np.testing.assert_allclose(base[0][0, la:], other[0][0, la:], rtol=1e-5, atol=1e-5)
    assert not np.allclose(base[0][0, :la], other[0][0, :la], atol=1e-3)
    # MTP depth 1 at position t uses token t+1: B's positions except its last are B-only.
    for a, b in zip(base[1], other[1]):
        np.testing.assert_allclose(a[0, la:-1], b[0, la:-1], rtol=1e-5, atol=1e-5)
    # The same document B alone in a row gives the same logits (nothing leaks from A at all).
    toks = jnp.asarray(doc_b[None].astype(np.int32))
    alone = run(toks, jnp.full_like(toks, 2), jnp.arange(lb, dtype=jnp.int32)[None])
    np.testing.assert_allclose(base[0][0, la:], alone[0][0], rtol=1e-4, atol=1e-4)
