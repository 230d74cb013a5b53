"""grain pipeline on real stdlib text: packing, masks, determinism, resume, per-host sharding."""

import collections
import json
import os
import sysconfig

import numpy as np
import pytest

from minimax_jax.data.pipeline import (
    DataConfig, DataConfigError, iterate_batches, make_train_iterator, restore_iterator_state,
    rows_to_example, save_iterator_state,
)
from minimax_jax.data.sources import DocumentSource
from minimax_jax.data.tokenizer import BOS, EOS, PAD, save_tokenizer, train_tokenizer_from_paths

STD = sysconfig.get_paths()["stdlib"]
SOURCES = (os.path.join(STD, "json", "*.py"), os.path.join(STD, "wsgiref", "*.py"))


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer_from_paths(list(SOURCES), 600)


@pytest.fixture(scope="module")
def tok_path(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(tok, str(d))
    return str(d)


@pytest.fixture(scope="module")
def docs(tok):
    """Tokenised documents (bos + ids + eos) in source order."""
    src = DocumentSource(SOURCES)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    return [[bos] + tok.encode(src[i], add_special_tokens=False).ids + [eos] for i in range(len(src))]


@pytest.fixture(scope="module")
def short_jsonl(tmp_path_factory):
    """Real stdlib code cut at blank lines into many short documents (JSONL, field "text")."""
    src = DocumentSource(SOURCES)
    pieces = [p.strip() for i in range(len(src)) for p in src[i].split("\n\n") if p.strip()]
    path = tmp_path_factory.mktemp("jsonl") / "short.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in pieces))
    return str(path), pieces


def cfg(tok_path, **kw):
    base = dict(sources=SOURCES, tokenizer=tok_path, seq_len=32, batch_size=2, seed=3)
    base.update(kw)
    return DataConfig(**base)


def rows(batches):
    """Packed rows of L + 1 tokens (inputs + last target), padding (pad id) removed."""
    out = []
    for b in batches:
        full = np.concatenate([b["tokens"], b["targets"][:, -1:]], axis=1)
        out.extend(full)
    return out


def split_docs(seq, bos):
    """Splits a token list at bos ids (each document starts with bos)."""
    out, cur = [], None
    for t in seq:
        if t == bos:
            if cur is not None:
                out.append(tuple(cur))
            cur = [t]
        elif cur is None:  # a row that starts inside a document
            cur = [t]
        else:
            cur.append(t)
    if cur is not None:
        out.append(tuple(cur))
    return out


def test_concat_packing_loses_no_token_and_keeps_order(tok, tok_path, docs):
    batches = iterate_batches(cfg(tok_path, batch_size=1, shuffle=False), 10**6, tokenizer=tok)
    pad = tok.token_to_id(PAD)
    stream = np.concatenate([r[r != pad] for r in rows(batches)])
    expected = np.concatenate([np.asarray(d) for d in docs])
    np.testing.assert_array_equal(stream, expected)
    for b in batches:
        for k in ("tokens", "targets", "segment_ids", "positions"):
            assert b[k].dtype == np.int32 and b[k].shape == (1, 32)
        assert b["loss_mask"].dtype == np.float32


def test_shuffled_epoch_holds_every_document_once(tok, tok_path, docs):
    batches = iterate_batches(cfg(tok_path, batch_size=1, seed=11), 10**6, tokenizer=tok)
    pad, bos = tok.token_to_id(PAD), tok.token_to_id(BOS)
    stream = np.concatenate([r[r != pad] for r in rows(batches)]).tolist()
    got = split_docs(stream, bos)
    assert collections.Counter(got) == collections.Counter(tuple(d) for d in docs)
    assert got != [tuple(d) for d in docs]  # the order really changed


def check_segments_positions_mask(b, bos, pad, concat):
    seg, pos, mask, tg = b["segment_ids"], b["positions"], b["loss_mask"], b["targets"]
    for r in range(seg.shape[0]):
        s, p = seg[r], pos[r]
        nz = s[s > 0]
        # 1-based, non-decreasing, consecutive; padding (0) only as a suffix
        assert nz[0] == 1 and np.all(np.diff(nz) >= 0) and np.all(np.diff(nz) <= 1)
        assert np.all(s[len(nz):] == 0)
        assert np.all(b["tokens"][r][s == 0] == pad)
        for k in np.unique(nz):
            np.testing.assert_array_equal(p[s == k], np.arange((s == k).sum()))
    m = mask.astype(bool)
    assert set(np.unique(mask)) <= {0.0, 1.0}
    # inside the row: 1 exactly where the input is real and the target is in the same segment
    np.testing.assert_array_equal(m[:, :-1], (seg[:, :-1] != 0) & (seg[:, 1:] == seg[:, :-1]))
    # never train on predicting a document start or padding
    assert not np.any(m & ((tg == bos) | (tg == pad) | (seg == 0)))
    if concat:  # pieces inside a row only meet at document starts: the mask is fully determined
        np.testing.assert_array_equal(m, (seg != 0) & (tg != bos) & (tg != pad))


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_segment_ids_positions_and_loss_mask(tok, tok_path, short_jsonl, packing):
    bos, pad = tok.token_to_id(BOS), tok.token_to_id(PAD)
    sources = SOURCES + (short_jsonl[0],)
    batches = iterate_batches(cfg(tok_path, packing=packing, sources=sources), 10**6, tokenizer=tok)
    assert len(batches) > 100
    for b in batches:
        check_segments_positions_mask(b, bos, pad, packing == "concat")
    # some row really holds a document boundary, and some mask entries are 0 because of it
    assert any(((b["segment_ids"] > 1).any()) for b in batches)


def test_first_fit_keeps_short_documents_whole(tok, tok_path, docs, short_jsonl):
    path, pieces = short_jsonl
    pad, bos, eos = tok.token_to_id(PAD), tok.token_to_id(BOS), tok.token_to_id(EOS)
    docs = docs + [[bos] + tok.encode(p, add_special_tokens=False).ids + [eos] for p in pieces]
    c = cfg(tok_path, packing="first_fit", batch_size=1, sources=SOURCES + (path,))
    batches = iterate_batches(c, 10**6, tokenizer=tok)
    pieces = []  # (row, segment) token runs, from segment ids; the last target joins its
    for b in batches:  # input's segment when the loss mask says so, else starts a new piece
        for r in range(b["tokens"].shape[0]):
            seg = b["segment_ids"][r].tolist()
            last = seg[-1] if b["loss_mask"][r, -1] else -1
            toks = b["tokens"][r].tolist() + [int(b["targets"][r, -1])]
            for t, sid in zip(toks, seg + [last]):
                if t == pad:
                    continue
                if pieces and pieces[-1][0] == (id(b), r, sid) and sid != -1:
                    pieces[-1][1].append(t)
                else:
                    pieces.append(((id(b), r, sid), [t]))
    got = collections.Counter(t for _, p in pieces for t in p)
    assert got == collections.Counter(t for d in docs for t in d)  # no token lost or added
    whole = collections.Counter(tuple(p) for _, p in pieces)
    short = [tuple(d) for d in docs if len(d) <= 33]
    assert len(short) > 50
    for d in short:  # every document that fits a row sits whole in one segment of one row
        assert whole[d] >= 1


def test_rows_to_example_by_hand():
    row = {
        "tokens": np.array([1, 5, 6, 2, 1, 7, 2, 0, 0]),
        "tokens_segment_ids": np.array([1, 1, 1, 1, 2, 2, 2, 0, 0]),
        "tokens_positions": np.array([0, 1, 2, 3, 0, 1, 2, 0, 0]),
    }
    ex = rows_to_example(row)
    np.testing.assert_array_equal(ex["tokens"], [1, 5, 6, 2, 1, 7, 2, 0])
    np.testing.assert_array_equal(ex["targets"], [5, 6, 2, 1, 7, 2, 0, 0])
    np.testing.assert_array_equal(ex["loss_mask"], [1, 1, 1, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(ex["positions"], [0, 1, 2, 3, 0, 1, 2, 0])


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x) and len(a) == len(b)


def test_deterministic_and_seed_dependent(tok, tok_path):
    a = iterate_batches(cfg(tok_path), 5, tokenizer=tok)
    b = iterate_batches(cfg(tok_path), 5, tokenizer=tok)
    c = iterate_batches(cfg(tok_path, seed=4), 5, tokenizer=tok)
    assert _same(a, b)
    assert not _same(a, c)


@pytest.mark.parametrize("packing,threads", [("concat", 0), ("first_fit", 0), ("concat", 2)])
def test_resume_from_state_gives_identical_batches(tok, tok_path, tmp_path, packing, threads):
    c = cfg(tok_path, packing=packing, num_threads=threads, num_epochs=None)
    it = make_train_iterator(c, tok)
    for _ in range(7):
        next(it)
    state = it.get_state()
    path = str(tmp_path / "state.json")
    save_iterator_state(it, path)
    json.load(open(path))  # really JSON
    expected = [next(it) for _ in range(6)]
    it2 = make_train_iterator(c, tok)
    it2.set_state(state)
    assert _same([next(it2) for _ in range(6)], expected)
    it3 = make_train_iterator(c, tok)
    restore_iterator_state(it3, path)
    assert _same([next(it3) for _ in range(6)], expected)


def test_per_host_shards_are_disjoint_and_cover(tok, tok_path, docs):
    pad, bos = tok.token_to_id(PAD), tok.token_to_id(BOS)
    got = []
    for i in range(2):
        c = cfg(tok_path, batch_size=2, shard_index=i, shard_count=2, seed=5)
        batches = iterate_batches(c, 10**6, tokenizer=tok)
        assert batches[0]["tokens"].shape == (1, 32)
        stream = np.concatenate([r[r != pad] for r in rows(batches)]).tolist()
        got.append(collections.Counter(split_docs(stream, bos)))
    assert not set(got[0]) & set(got[1])
    assert got[0] + got[1] == collections.Counter(tuple(d) for d in docs)


def test_two_epochs_repeat_every_document(tok, tok_path, docs):
    pad, bos = tok.token_to_id(PAD), tok.token_to_id(BOS)
    batches = iterate_batches(cfg(tok_path, batch_size=1, num_epochs=2), 10**6, tokenizer=tok)
    stream = np.concatenate([r[r != pad] for r in rows(batches)]).tolist()
    got = collections.Counter(split_docs(stream, bos))
    assert got == collections.Counter(tuple(d) for d in docs for _ in range(2))


def test_jsonl_source_through_pipeline(tok, tmp_path):
    p = tmp_path / "d.jsonl"
    texts = [f"line {i}: " + "word " * (i + 3) for i in range(20)]
    p.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    c = DataConfig(sources=(str(p),), tokenizer="unused", seq_len=16, batch_size=1, field="body",
                   shuffle=False, add_bos=False, add_eos=False)
    stream = np.concatenate([r[r != 0] for r in rows(iterate_batches(c, 10**6, tokenizer=tok))])
    expected = np.concatenate([tok.encode(t, add_special_tokens=False).ids for t in texts])
    np.testing.assert_array_equal(stream, expected)


def test_config_errors(tok, tok_path):
    with pytest.raises(DataConfigError, match="divisible"):
        make_train_iterator(cfg(tok_path, batch_size=3, shard_index=0, shard_count=2), tok)
    with pytest.raises(DataConfigError, match="unknown DataConfig keys: \\['bogus'\\]"):
        DataConfig.from_dict(dict(sources=SOURCES, tokenizer="t", seq_len=8, batch_size=1, bogus=1))
    with pytest.raises(DataConfigError, match="packing"):
        cfg(tok_path, packing="zigzag")
    with pytest.raises(DataConfigError, match="seq_len"):
        cfg(tok_path, seq_len=0)
    with pytest.raises(DataConfigError, match="shard_index"):
        cfg(tok_path, shard_index=2, shard_count=2)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        make_train_iterator(cfg(os.path.join(tok_path, "nope")))


def test_default_shard_comes_from_jax(tok_path):
    import jax

    assert cfg(tok_path).shard() == (jax.process_index(), jax.process_count())


def test_resume_through_grain_orbax_handler(tok, tok_path, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    import grain

    c = cfg(tok_path, num_epochs=None)
    it = make_train_iterator(c, tok)
    for _ in range(4):
        next(it)
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as mngr:
        mngr.save(4, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
    expected = [next(it) for _ in range(3)]
    it2 = make_train_iterator(c, tok)
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as mngr:
        mngr.restore(4, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(it2)))
    assert _same([next(it2) for _ in range(3)], expected)


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_stream_does_not_depend_on_tokenize_batch(tok, tok_path, packing):
    a = iterate_batches(cfg(tok_path, packing=packing, tokenize_batch=1), 40, tokenizer=tok)
    b = iterate_batches(cfg(tok_path, packing=packing, tokenize_batch=5), 40, tokenizer=tok)
    assert len(a) == 40 and _same(a, b)
