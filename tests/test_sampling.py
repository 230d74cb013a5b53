"""Sampling (minimax_jax/sampling.py) and host-side stop handling (minimax_jax/stopping.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minimax_jax.sampling import filter_logits, greedy, sample
from minimax_jax.stopping import (StopChecker, StopConfig, find_stop_string, held_back_length,
                                  repetition_period)


# Inputs are built with numpy: on CPU every distinct eager jnp op compiles, which is slow.
def random_logits(seed=0, b=8, v=50, scale=3.0):
    return (np.random.default_rng(seed).standard_normal((b, v)) * scale).astype(np.float32)


def logits_of(probs, rows=1):
    return np.log(np.asarray([probs] * rows, np.float32))


# ---------------------------------------------------------------- sampling

def test_greedy_is_argmax_and_temperature_zero_is_greedy():
    x = random_logits()
    want = np.argmax(np.asarray(x), axis=-1)
    np.testing.assert_array_equal(greedy(x), want)
    got = sample(x, jax.random.key(1), temperature=0.0, top_k=5, top_p=0.5)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == jnp.int32 and got.shape == (8,)


def test_top_k_one_is_greedy_for_any_key_and_temperature():
    x = random_logits(2)
    want = np.argmax(np.asarray(x), axis=-1)
    for seed in range(5):
        got = sample(x, jax.random.key(seed), temperature=1.7, top_k=1)
        np.testing.assert_array_equal(got, want)


def test_small_temperature_approaches_greedy():
    # Logit gaps of at least 0.05 divided by t = 1e-3 make every non-argmax probability
    # <= V * exp(-50): no draw can differ from greedy.
    v = 40
    rng = np.random.default_rng(0)
    x = np.stack([rng.permutation(v) * 0.05 for _ in range(64)]).astype(np.float32)
    got = sample(x, jax.random.key(3), temperature=1e-3)
    np.testing.assert_array_equal(got, np.argmax(np.asarray(x), axis=-1))
    # ...while at temperature 1 the same rows are not all greedy (the test can fail).
    hot = sample(x, jax.random.key(3), temperature=1.0)
    assert np.any(np.asarray(hot) != np.argmax(np.asarray(x), axis=-1))


def test_top_p_keeps_nucleus_exactly():
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    kept = np.isfinite(np.asarray(filter_logits(x, top_p=0.85)))[0]
    np.testing.assert_array_equal(kept, [True, True, True, False])
    kept = np.isfinite(np.asarray(filter_logits(x, top_p=0.45)))[0]
    np.testing.assert_array_equal(kept, [True, False, False, False])
    kept = np.isfinite(np.asarray(filter_logits(x, top_p=1.0)))[0]
    assert kept.all()


def test_top_p_statistics_over_many_draws():
    """20,000 draws with top_p=0.85 from [0.5, 0.3, 0.15, 0.05]: the 0.05 token never appears and
    each kept token's frequency is within 5 standard deviations (sqrt(q(1-q)/N) <= 0.0036) of
    its renormalised probability q = p / 0.95; a false failure has probability < 1e-6 per token,
    and the seed is fixed, so the outcome is deterministic."""
    n = 20_000
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    toks = np.asarray(sample(logits_of(probs, n), jax.random.key(11), top_p=0.85))
    counts = np.bincount(toks, minlength=4)
    assert counts[3] == 0
    q = probs[:3] / probs[:3].sum()
    tol = 5 * np.sqrt(q * (1 - q) / n)
    np.testing.assert_array_less(np.abs(counts[:3] / n - q), tol)


def test_plain_sampling_matches_softmax_statistics():
    n = 20_000
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    toks = np.asarray(sample(logits_of(probs, n), jax.random.key(5)))
    freq = np.bincount(toks, minlength=4) / n
    np.testing.assert_array_less(np.abs(freq - probs), 5 * np.sqrt(probs * (1 - probs) / n))


def test_top_k_and_min_p_masks():
    x = logits_of([0.35, 0.3, 0.2, 0.1, 0.05])
    kept = np.isfinite(np.asarray(filter_logits(x, top_k=2)))[0]
    np.testing.assert_array_equal(kept, [1, 1, 0, 0, 0])
    # min_p 0.5: keep p >= 0.175
    kept = np.isfinite(np.asarray(filter_logits(x, min_p=0.5)))[0]
    np.testing.assert_array_equal(kept, [1, 1, 1, 0, 0])
    # order: top-k first, then top-p over the renormalised top-3 (0.35/0.85 = 0.41 < 0.5)
    kept = np.isfinite(np.asarray(filter_logits(x, top_k=3, top_p=0.5)))[0]
    np.testing.assert_array_equal(kept, [1, 1, 0, 0, 0])


def test_temperature_scales_kept_logits():
    x = random_logits(4)
    np.testing.assert_allclose(filter_logits(x, temperature=0.5), np.asarray(x) / 0.5, rtol=1e-6)


def test_reproducible_by_seed_and_different_seeds_differ():
    x = random_logits(5, b=64, v=100, scale=0.5)
    a = sample(x, jax.random.key(7), top_p=0.95, top_k=40)
    b = sample(x, jax.random.key(7), top_p=0.95, top_k=40)
    c = sample(x, jax.random.key(8), top_p=0.95, top_k=40)
    np.testing.assert_array_equal(a, b)
    assert np.any(np.asarray(a) != np.asarray(c))
    raw = sample(x, jax.random.PRNGKey(7), top_p=0.95, top_k=40)  # raw uint32 key works too
    np.testing.assert_array_equal(raw, sample(x, jax.random.PRNGKey(7), top_p=0.95, top_k=40))


def test_jit_matches_eager():
    x = random_logits(6)
    t = np.linspace(0.0, 1.5, 8).astype(np.float32)
    f = jax.jit(lambda l, k, t: sample(l, k, temperature=t, top_k=10, top_p=0.9))
    np.testing.assert_array_equal(f(x, jax.random.key(2), t),
                                  sample(x, jax.random.key(2), temperature=t, top_k=10, top_p=0.9))


def test_per_row_parameters_equal_row_by_row():
    x = random_logits(9, b=4, v=30)
    temp = np.array([0.7, 1.0, 1.3, 2.0], np.float32)
    top_k = np.array([0, 3, 10, 1], np.int32)
    top_p = np.array([0.9, 1.0, 0.5, 0.8], np.float32)
    min_p = np.array([0.0, 0.1, 0.0, 0.3], np.float32)
    batch = np.asarray(filter_logits(x, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p))
    for i in range(4):
        row = filter_logits(x[i:i + 1], temperature=float(temp[i]), top_k=int(top_k[i]),
                            top_p=float(top_p[i]), min_p=float(min_p[i]))
        np.testing.assert_array_equal(batch[i], np.asarray(row)[0])
    # rows with temperature 0 are greedy while other rows sample
    t0 = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
    got = np.asarray(sample(x, jax.random.key(0), temperature=t0))
    np.testing.assert_array_equal(got[[0, 2]], np.argmax(np.asarray(x)[[0, 2]], axis=-1))


def test_per_row_keys_make_rows_independent_of_batch_position():
    x = random_logits(10, b=6, v=1000, scale=0.1)
    keys = jax.random.split(jax.random.key(4), 6)
    batch = np.asarray(sample(x, keys))
    raw = np.asarray(jax.random.key_data(keys))  # [6, 2] uint32: the raw-key form
    np.testing.assert_array_equal(np.asarray(sample(x, raw)), batch)
    for i in range(6):
        assert batch[i] == int(sample(x[i:i + 1], raw[i])[0])
    perm = np.array([3, 0, 5, 1, 4, 2])
    np.testing.assert_array_equal(np.asarray(sample(x[perm], raw[perm])), batch[perm])


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature"), (dict(top_p=1.5), "top_p"),
    (dict(min_p=-0.1), "min_p"), (dict(top_k=-2), "top_k"),
    (dict(temperature=np.ones(3)), r"shape \(8,\)"),
])
def test_bad_parameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample(random_logits(), jax.random.key(0), **kwargs)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        greedy(np.zeros((5,), np.float32))
    with pytest.raises(ValueError, match="keys for a batch"):
        sample(random_logits(), jax.random.split(jax.random.key(0), 3))


# ---------------------------------------------------------------- stop handling

def feed(checker, pieces):
    """Feed tokens 0..n-1 whose texts are ``pieces``; returns the result."""
    text = ""
    for i, p in enumerate(pieces):
        text += p
        if checker.update(i + 100, text):
            break
    return checker.result


def test_stop_token_excludes_its_text():
    c = StopChecker(StopConfig(stop_token_ids={200020}))
    assert c.update(5, "Hello") is None
    r = c.update(200020, "Hello[e~[")
    assert (r.reason, r.text, r.num_tokens, r.detail) == ("stop_token", "Hello", 1, 200020)
    with pytest.raises(RuntimeError, match="already stopped"):
        c.update(1, "x")


def test_stop_string_across_tokens_is_trimmed():
    c = StopChecker(StopConfig(stop_strings=("STOP", "\nUser:")))
    r = feed(c, ["Hi", " th", "ere\nUs", "er:", " more"])
    assert (r.reason, r.text, r.detail, r.num_tokens) == ("stop_string", "Hi there", "\nUser:", 4)


def test_earliest_and_longest_stop_string():
    assert find_stop_string("abcSTOPxEND", ["END", "STOP"]) == (3, "STOP")
    assert find_stop_string("ab##c", ["#", "##"]) == (2, "##")
    assert find_stop_string("abc", ["x"]) is None


def test_emittable_text_holds_back_possible_stop_prefix():
    c = StopChecker(StopConfig(stop_strings=("</answer>",)))
    c.update(1, "The result </ans")
    assert c.emittable_text() == "The result "
    c.update(2, "The result </ans>")
    assert c.emittable_text() == "The result </ans>"
    assert held_back_length("xx<", ["<a>", "b"]) == 1


def test_repetition_rule():
    assert repetition_period([1, 2, 3, 3, 3, 3], max_period=1, max_count=3) == 1
    assert repetition_period([1, 2, 3, 3, 3], max_period=1, max_count=3) is None
    cyc = [9] + [4, 5, 6] * 3
    assert repetition_period(cyc, max_period=3, max_count=2) == 3
    assert repetition_period(cyc, max_period=2, max_count=2) is None
    assert repetition_period(cyc, max_period=3, max_count=3) is None
    assert repetition_period([1, 1, 1], 0, 0) is None


def test_repetition_and_length_stops():
    c = StopChecker(StopConfig(repeat_max_period=2, repeat_max_count=2))
    text = ""
    for i, t in enumerate([1, 7, 8, 7, 8, 7, 8, 5]):
        text += str(t)
        if c.update(t, text):
            break
    assert (c.result.reason, c.result.detail, c.result.num_tokens) == ("repetition", 2, 7)
    c = StopChecker(StopConfig(max_new_tokens=3))
    r = c.run((t, "x" * (t + 1)) for t in range(10))
    assert (r.reason, r.num_tokens, r.text) == ("length", 3, "xxx")


@pytest.mark.parametrize("kwargs, match", [
    (dict(stop_strings="STOP"), "not one string"), (dict(stop_strings=("",)), "non-empty"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(repeat_max_period=2), "both"),
])
def test_bad_stop_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StopConfig(**kwargs)
