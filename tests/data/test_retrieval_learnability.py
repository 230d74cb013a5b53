"""The path of a retrieval training document, end to end: nothing in it may hide the answer.

A retrieval document (minimax_jax.data.retrieval) goes through the grain pipeline (tokenise with
BOS/EOS, first-fit packing, inputs/targets/segments/positions/loss mask) into a training row. For the
model to be able to learn retrieval, in every packed row:

- every token of a document (answer digits included) is the target of the previous token with loss
  weight 1 (only the document's last target, the next row entry, is masked);
- the whole document, needles and questions, is one segment with positions 0, 1, 2, ... (so the
  needle is visible to the question under the segment mask and RoPE sees true distances);
- the eval prompt + reference completion tokenise to exactly the document's first tokens (the eval
  asks in the training wording and tokenisation), and the scorer gives the reference full credit.
"""

import json
import re

import numpy as np
import pytest

from minimax_jax.data.pipeline import DataConfig, iterate_batches
from minimax_jax.data.retrieval import make_document
from minimax_jax.data.tokenizer import BOS, EOS, save_tokenizer, train_tokenizer
from minimax_jax.data.haystack import char_counter, noise_haystack
from minimax_jax.eval.scoring import score_output
from minimax_jax.data.tasks import completion, generate

TASKS = ("niah_single", "niah_multikey", "variable_tracking", "niah_multivalue")
SEQ_LEN = 1024


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    hay = noise_haystack()
    docs = [make_document(TASKS[i % len(TASKS)], i, hay, seed=0, min_chars=300, max_chars=900)
            for i in range(24)]
    docs = [d for d in docs if d is not None]
    d = tmp_path_factory.mktemp("retrieval")
    path = d / "train.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in docs))
    tok = train_tokenizer([x["text"] for x in docs], 300)
    save_tokenizer(tok, str(d / "tok"))
    return docs, str(path), tok, str(d / "tok")


def test_packed_rows_supervise_every_answer_token(corpus):
    docs, path, tok, tok_dir = corpus
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    want = {tuple([bos] + tok.encode(x["text"], add_special_tokens=False).ids + [eos]) for x in docs}
    assert max(len(w) for w in want) <= SEQ_LEN + 1, "the test needs whole documents in a row"
    cfg = DataConfig(sources=(path,), tokenizer=tok_dir, seq_len=SEQ_LEN, batch_size=4, seed=1,
                     packing="first_fit", shard_index=0, shard_count=1, num_epochs=None, shuffle=False)
    seen = set()
    for b in iterate_batches(cfg, 12):   # repeats: every document is packed at least once
        for r in range(b["tokens"].shape[0]):
            t, y, s, p, m = (b[k][r] for k in ("tokens", "targets", "segment_ids", "positions", "loss_mask"))
            np.testing.assert_array_equal(t[1:], y[:-1])
            for seg in np.unique(s[s > 0]):
                idx = np.where(s == seg)[0]
                np.testing.assert_array_equal(idx, np.arange(idx[0], idx[0] + len(idx)))   # contiguous
                np.testing.assert_array_equal(p[idx], np.arange(len(idx)))                 # true positions
                ids = tuple(t[idx].tolist())
                if ids[-1] != eos:   # the document's EOS is the row's extra last token: a target only
                    ids += (int(y[idx[-1]]),)
                assert ids in want, "a packed segment is not one whole document"
                # every next-token target inside the document is supervised (answer digits included)
                assert m[idx[:-1]].all() and (m[idx[-1]] == 1) == (y[idx[-1]] == eos)
                seen.add(ids)
            assert not m[s == 0].any()
    assert seen == want


@pytest.mark.parametrize("task", TASKS)
def test_eval_prompt_is_the_training_prefix(corpus, task):
    docs, _, tok, _ = corpus
    n = 0
    for d in docs:
        if d["source"] != f"synthetic:{task}":
            continue
        # The document's first question ends with the eval prompt's answer prefix ("... is" / "... are").
        text = d["text"]
        prompt = text[: re.search(r"\nAnswer: [^\n]*? (?:is|are)(?= )", text).end()]
        ids = tok.encode(text, add_special_tokens=False).ids
        p = tok.encode(prompt, add_special_tokens=False).ids
        assert ids[: len(p)] == p, f"{d['id']}: eval prompt tokens are not a prefix of the training tokens"
        n += 1
    assert n
    ex = generate(task, 600, char_counter, noise_haystack(), seed=0, index=3)
    full = tok.encode(ex.prompt + completion(ex), add_special_tokens=False).ids
    p = tok.encode(ex.prompt, add_special_tokens=False).ids
    assert full[: len(p)] == p
    out = tok.decode(full[len(p):])   # what greedy decoding of the reference would return
    assert score_output(ex.answers, out) == 1.0 and score_output(ex.answers, out, "exact") == 1.0
