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


def test_state_over_other_trajectories_is_refused(tmp_path):
    """A checkpoint's data position means nothing over changed files: set_state names the change (the training
    loop restores it before writing anything, so train.py exits 2 and the run is kept as it was)."""
    it = _it()
    next(it)
    state = it.get_state()
    lines = open(SRC, encoding="utf-8").read().splitlines()
    _write(tmp_path, lines[:-1], name="fewer.jsonl")             # one rollout dropped
    other = _it(sources=(str(tmp_path / "fewer.jsonl"),))
    with pytest.raises(TrajectoryError, match=r"differ from those the checkpoint was trained on .*trajectory \d+"):
        other.set_state(state)
    same = _it(sources=(str(tmp_path / "fewer.jsonl"),))
    same.set_state({"index": 1})                                   # a state from before fingerprints: taken as is
    assert same.index == 1
    _write(tmp_path, lines, name="copy.jsonl")                     # the same trajectories in another file: fine
    copy = _it(sources=(str(tmp_path / "copy.jsonl"),))
    copy.set_state(state)
    assert copy.index == it.index


def test_a_directory_source_takes_its_jsonl_files_only(tmp_path):
    """A directory of rollouts may hold notes and logs beside them: only its .jsonl files are read; one without
    any is refused by name."""
    d = tmp_path / "rollouts"
    d.mkdir()
    (d / "a.jsonl").write_text(open(SRC, encoding="utf-8").read())
    (d / "README.md").write_text("# not a trajectory\n")
    (d / "run.log").write_bytes(b"\xff\xfe binary")
    it, ref = _it(sources=(str(d),)), _it()
    assert it.fingerprint == ref.fingerprint
    (d / "a.jsonl").unlink()
    with pytest.raises(TrajectoryError, match="holds no .jsonl file"):
        _it(sources=(str(d),))


def test_bad_settings_are_refused():
    with pytest.raises(TrajectoryError, match="key_len must be an int >= 0"):
        _it(key_len=-1)
    with pytest.raises(TrajectoryError, match="key_len must be 0 or >= seq_len=1280"):
        _it(key_len=1000)
    with pytest.raises(TrajectoryError, match="unknown trajectory data keys"):
        _it(keylen=4)


def _write(tmp_path, lines, name="t.jsonl", data=None):
    p = tmp_path / name
    if data is not None:
        p.write_bytes(data)
    else:
        p.write_text("".join(line + "\n" for line in lines))
    return str(p)


def _tok_it(src, **kw):
    cfg = dict(sources=(src,), seq_len=64, batch_size=2, num_epochs=None)
    vocab = kw.pop("vocab_size", None)
    cfg.update(kw)
    return TrajectoryIterator(TrajectoryConfig.from_dict(cfg), vocab_size=vocab)


def test_a_step_holds_each_trajectory_once_and_an_epoch_ends_a_step(tmp_path):
    """All trajectories fit one step: each step is one pass over the file (it used to wrap round the file and
    double the count of free, identical merges towards 2^30: a hang), and two epochs are two steps."""
    one = _tok_it(_write(tmp_path, ['{"tokens": [1, 2, 3, 4]}']))
    for _ in range(3):
        next(one)
        assert one.last_stats.tokens_before == 4
    assert one.index == 3
    rows = ['{"tokens": [1, 2, %d]}' % i for i in range(3, 9)]
    two = _tok_it(_write(tmp_path, rows, "six.jsonl"), num_epochs=2)
    sizes = []
    for _ in two:
        sizes.append(two.last_stats.tokens_before)
    assert sizes == [18, 18] and two.index == 12
    capped = _it(max_trajectories=64)                  # the shipped rollouts: no trajectory twice in a step
    next(capped)
    assert capped.index <= 12


@pytest.mark.parametrize("record,needle", [
    ('{"tokens": ["a", "b"]}', "'tokens' must be a non-empty list of integer token ids"),
    ('{"tokens": [1.7, 2.2]}', "'tokens' must be a non-empty list of integer token ids"),
    ('{"tokens": [true, false]}', "'tokens' must be a non-empty list of integer token ids"),
    ('{"tokens": []}', "'tokens' must be a non-empty list of integer token ids"),
    ('{"tokens": [1, -3, 2]}', "token id -3 is out of range"),
    ('{"tokens": [1, 2, 600]}', "token id 600 is not below the model's vocab_size 512"),
    ('{"tokens": [1, 2, 3], "loss_mask": [1, 100, 1]}', "'loss_mask' must be a list of 0 / 1, one per token (3)"),
    ('{"tokens": [1, 2, 3], "loss_mask": [1, 0.5, 1]}', "'loss_mask' must be a list of 0 / 1, one per token (3)"),
    ('{"tokens": [1, 2, 3], "loss_mask": [1, "x", 1]}', "'loss_mask' must be a list of 0 / 1"),
    ('{"tokens": [1, 2, 3], "loss_mask": [1, 1]}', "'loss_mask' must be a list of 0 / 1, one per token (3)"),
    ('{"tokens": %s}' % list(range(1, 70)), "69 tokens do not fit a row of seq_len=64"),
    ('{"tokens": [1, 2', "invalid JSON"),
])
def test_bad_records_are_refused_up_front_naming_the_line(tmp_path, record, needle):
    src = _write(tmp_path, ['{"tokens": [1, 2, 3]}', record])
    with pytest.raises(TrajectoryError) as e:
        _tok_it(src, vocab_size=512)
    assert f"{src} line 2: " in str(e.value) and needle in str(e.value), str(e.value)


def test_files_without_a_trained_token_or_utf8_are_refused_and_a_bom_is_dropped(tmp_path):
    with pytest.raises(TrajectoryError, match="no trajectory has a trained token"):
        _tok_it(_write(tmp_path, ['{"tokens": [1, 2, 3], "loss_mask": [1, 0, 0]}']))
    with pytest.raises(TrajectoryError, match="no assistant turn in a conversation"):
        _it(sources=(_write(tmp_path, ['{"messages": [{"role": "user", "content": "hi"}]}'], "user.jsonl"),))
    latin = _write(tmp_path, None, "latin.jsonl", data='{"tokens": [1, 2]} \xe9\n'.encode("latin-1"))
    with pytest.raises(TrajectoryError, match=f"{latin}: not UTF-8 text"):
        _tok_it(latin)
    bom = _write(tmp_path, None, "bom.jsonl", data=b'\xef\xbb\xbf{"tokens": [1, 2, 3]}\n')
    next(_tok_it(bom))
    floats = _tok_it(_write(tmp_path, ['{"tokens": [1, 2, 3], "loss_mask": [0.0, 1.0, true]}'], "f.jsonl"))
    np.testing.assert_array_equal(floats.trajectories[0].loss_mask, [0, 1, 1])   # numpy's tolist() writes floats


def test_merge_must_be_a_bool():
    with pytest.raises(TrajectoryError, match="merge must be true or false, got 'false'"):
        TrajectoryConfig(sources=(SRC,), seq_len=64, batch_size=1, merge="false")
