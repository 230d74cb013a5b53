"""The agent-trajectory source (``minimax_jax.data.trajectories``) on the shipped example rollouts: conversations
rendered with the chat template and tokenised, loss on the assistant turns, each step packing as many whole
trajectories as fit; ``key_len`` adds the per-trajectory key layout (and limits what fits); state resumes
the exact next batch; bad settings get a one-line error."""

import functools

import numpy as np
import pytest

from minimax_jax.chat import render_chat
from minimax_jax.data.prefix_tree import KEY_KEYS, ROW_KEYS
from minimax_jax.data.trajectories import TrajectoryConfig, TrajectoryError, TrajectoryIterator

SRC = "configs/tiny-data/agent_trajectories.jsonl"
TOK = "configs/tiny-data/tokenizer.json"
RENDER = functools.partial(render_chat, add_generation_prompt=False)


def _it(**kw):
    cfg = dict(sources=(SRC,), seq_len=1280, batch_size=3, tokenizer=TOK, num_epochs=None)
    cfg.update(kw)
    return TrajectoryIterator(TrajectoryConfig.from_dict(cfg), render=RENDER)


def test_batches_merge_shared_prefixes_and_train_assistant_turns():
    it = _it()
    b = next(it)
    assert set(b) == set(ROW_KEYS) and b["tokens"].shape == (3, 1280)
    st = it.last_stats
    assert st.tokens_after < st.tokens_before and it.index >= 2
    assert 0 < b["loss_mask"].sum() < (b["segment_ids"] > 0).sum()      # assistant turns only
    assert b["input_weight"].sum() == st.tokens_before - it.index       # every token but each last one


def test_key_len_adds_the_key_layout_and_limits_the_step():
    free, keyed = _it(), _it(key_len=2048)
    next(free)
    k = next(keyed)
    assert set(k) == set(ROW_KEYS) | set(KEY_KEYS) and k["key_slot"].shape == (3, 2048)
    for r in range(3):             # each row's key entries are its trajectories' paths, unmerged
        used = k["key_segment_ids"][r] > 0
        slots = k["key_slot"][r, used]
        np.testing.assert_array_equal(k["positions"][r, slots], k["key_positions"][r, used])
        assert (k["segment_ids"][r, slots] > 0).all()
        # a slot's query segment names a trajectory whose key run holds that very slot (its ancestors' run)
        live = k["segment_ids"][r] > 0
        qs = k["query_segment_ids"][r]
        assert (qs[live] > 0).all() and (qs[~live] == -1).all()
        pairs = set(zip(k["key_segment_ids"][r, used].tolist(), slots.tolist()))
        assert all((int(qs[s]), int(s)) in pairs for s in np.flatnonzero(live))
    tight = _it(key_len=1280)                   # the key layout holds the trajectories unmerged: fewer fit
    next(tight)
    assert tight.index < keyed.index < free.index


def test_state_resumes_the_exact_next_batch():
    it = _it()
    next(it)
    state = it.get_state()
    want = next(it)
    again = _it()
    again.set_state(state)
    got = next(again)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_bad_settings_are_refused():
    with pytest.raises(TrajectoryError, match="key_len must be an int >= 0"):
        _it(key_len=-1)
    with pytest.raises(TrajectoryError, match="key_len must be 0 or >= seq_len=1280"):
        _it(key_len=1000)
    with pytest.raises(TrajectoryError, match="unknown trajectory data keys"):
        _it(keylen=4)
