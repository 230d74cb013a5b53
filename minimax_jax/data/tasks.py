"""RULER-style synthetic long-context tasks, deterministic from a seed, at a requested length.

Tasks (names used by the CLI):

- ``niah_single``: one passkey (7-digit number) hidden at a depth in the haystack; recall it.
- ``niah_multikey``: several ``name -> code`` statements; recall the code of one name.
- ``niah_multivalue``: one name stated with several codes; recall all of them.
- ``variable_tracking``: chains of assignments ``VAR A = 12345.`` / ``VAR B = VAR A.`` spread
  through the haystack; list every variable holding the queried value.
- ``common_words``: a numbered word list; name the most frequent words.

Every generator has the signature ``(rng, target_len, count, haystack, **params) -> Example``:
the prompt's length measured by ``count`` (tokens of the model's tokenizer, or characters) is at
most ``target_len`` and at least ``target_len - max(2, target_len // 2000)`` (or within one
filler word / list item of it when a single step is larger; see ``haystack.fit_length``).
The prompt ends with an answer prefix, so a base model continues with the answer;
:func:`completion` is the reference continuation.
All wording here is written for this project.
"""

from __future__ import annotations

import dataclasses
import random
import string
from collections.abc import Callable, Sequence
from typing import Any

from minimax_jax.data.haystack import CountFn, Haystack, LengthError, fit_length, insert_needles

_ADJECTIVES = (
    "amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly",
    "keen", "lucky", "misty", "noble", "olive", "proud", "quiet", "rapid", "silver", "tidy",
    "upper", "vivid", "wild", "young", "zesty", "bold", "crimson", "deep", "early", "fuzzy",
)
_NOUNS = (
    "falcon", "harbor", "lantern", "meadow", "canyon", "pebble", "orchard", "compass", "violin",
    "glacier", "thimble", "beacon", "saddle", "kettle", "anchor", "willow", "marble", "summit",
    "ribbon", "tunnel", "quarry", "garnet", "pillow", "basket", "candle", "dragon", "feather",
    "island", "jacket", "ladder",
)


@dataclasses.dataclass(frozen=True)
class Example:
    """One synthetic task instance.

    Attributes:
      task: task name.
      prompt: full prompt text, ending with an answer prefix.
      answers: expected answer strings (all must appear for full credit).
      target_length: requested length (in ``count`` units).
      length: measured length of ``prompt``.
      metadata: task details (depths, needles, haystack name, seed, index).
    """

    task: str
    prompt: str
    answers: tuple[str, ...]
    target_length: int
    length: int
    metadata: dict[str, Any]


def completion(example: Example) -> str:
    """Reference continuation of ``example.prompt``: the answers joined by ``", "``, then ``"."``."""
    return " " + ", ".join(example.answers) + "."


def _number(rng: random.Random, used: set[str]) -> str:
    while True:
        v = str(rng.randrange(1_000_000, 10_000_000))
        if v not in used:
            used.add(v)
            return v


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        v = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if v not in used:
            used.add(v)
            return v


def _var(rng: random.Random, used: set[str]) -> str:
    while True:
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if v not in used:
            used.add(v)
            return v


def _haystack_example(
    task: str, rng: random.Random, target_len: int, count: CountFn, haystack: Haystack,
    head: str, needles: list[tuple[float, str]], tail: str, answers: Sequence[str],
    metadata: dict[str, Any],
) -> Example:
    start = haystack.start_offset(rng)

    def build(n: int) -> str:
        context = insert_needles(haystack.piece(start, n), needles)
        return f"{head}\n\n{context}\n\n{tail}"

    # Filler bound: 1.5x the length at the filler's measured density (chars per unit), so huge
    # contexts are not over-measured; 16 chars per unit as the fallback bound.
    sample = haystack.piece(start, 20_000)
    density = len(sample) / max(count(sample), 1)
    try:
        _, prompt, length = fit_length(build, target_len, count, int(1.5 * density * target_len) + 256)
    except LengthError as e:
        if "not enough filler" not in str(e):
            raise
        _, prompt, length = fit_length(build, target_len, count, 16 * target_len + 256)
    meta = dict(metadata, haystack=haystack.name, start=start,
                needles=[s for _, s in needles], depths=[d for d, _ in needles])
    return Example(task, prompt, tuple(answers), target_len, length, meta)


def niah_single(rng, target_len, count, haystack, *, depth: float | None = None) -> Example:
    """Single needle: a 7-digit passkey at ``depth`` (seeded uniform in [0, 1] when None)."""
    d = rng.random() if depth is None else float(depth)
    value = _number(rng, set())
    head = ("Below is a long text. Somewhere inside it a secret passkey is stated. "
            "Remember the passkey; you will be asked for it at the end.")
    needle = f"The secret passkey is {value}. Keep {value} in mind."
    tail = "What is the secret passkey stated in the text above?\nAnswer: The secret passkey is"
    return _haystack_example("niah_single", rng, target_len, count, haystack, head,
                             [(d, needle)], tail, [value], {"depth": d})


def niah_multikey(rng, target_len, count, haystack, *, num_keys: int = 4) -> Example:
    """Multi-key needles: ``num_keys`` name -> code statements at seeded depths; one is asked."""
    if num_keys < 1:
        raise ValueError(f"num_keys must be >= 1, got {num_keys}")
    names, values = set(), set()
    pairs = [(_name(rng, names), _number(rng, values)) for _ in range(num_keys)]
    needles = [(rng.random(), f"The special code for {k} is {v}.") for k, v in pairs]
    qi = rng.randrange(num_keys)
    key, value = pairs[qi]
    head = ("Below is a long text. Special codes, each tied to a name, are hidden inside it. "
            "Remember them; you will be asked for one at the end.")
    tail = f"What is the special code for {key} in the text above?\nAnswer: The special code for {key} is"
    return _haystack_example("niah_multikey", rng, target_len, count, haystack, head, needles, tail,
                             [value], {"key": key, "query_index": qi, "depth": needles[qi][0]})


def niah_multivalue(rng, target_len, count, haystack, *, num_values: int = 4) -> Example:
    """Multi-value needles: one name stated with ``num_values`` codes; all must be recalled."""
    if num_values < 1:
        raise ValueError(f"num_values must be >= 1, got {num_values}")
    key = _name(rng, set())
    used: set[str] = set()
    vals = [_number(rng, used) for _ in range(num_values)]
    needles = [(rng.random(), f"One of the special codes for {key} is {v}.") for v in vals]
    head = ("Below is a long text. Several special codes for one name are hidden inside it. "
            "Remember all of them; you will be asked for them at the end.")
    tail = (f"List every special code for {key} given in the text above.\n"
            f"Answer: The special codes for {key} are")
    return _haystack_example("niah_multivalue", rng, target_len, count, haystack, head, needles,
                             tail, vals, {"key": key})


def variable_tracking(rng, target_len, count, haystack, *, num_hops: int = 4,
                      num_chains: int = 2) -> Example:
    """Variable tracking: ``num_chains`` assignment chains of ``num_hops + 1`` variables each,
    placed in order at seeded depths; the answer lists the variables of the first chain."""
    if num_hops < 1 or num_chains < 1:
        raise ValueError(f"num_hops and num_chains must be >= 1, got {num_hops}, {num_chains}")
    names: set[str] = set()
    values: set[str] = set()
    needles: list[tuple[float, str]] = []
    chains = []
    for _ in range(num_chains):
        value = str(rng.randrange(10_000, 100_000))
        while value in values:
            value = str(rng.randrange(10_000, 100_000))
        values.add(value)
        chain = [_var(rng, names) for _ in range(num_hops + 1)]
        depths = sorted(rng.random() for _ in chain)
        needles.append((depths[0], f"VAR {chain[0]} = {value}."))
        for prev, cur, d in zip(chain, chain[1:], depths[1:]):
            needles.append((d, f"VAR {cur} = VAR {prev}."))
        chains.append((value, chain))
    value, chain = chains[0]
    head = ("Below is a long text with variable assignments hidden inside it. "
            "Track the assignments; you will be asked about them at the end.")
    tail = (f"Which variables are assigned the value {value}, directly or through other variables? "
            f"List all of them.\nAnswer: The variables assigned the value {value} are")
    return _haystack_example("variable_tracking", rng, target_len, count, haystack, head, needles,
                             tail, chain, {"value": value, "chains": chains})


def _word_list_builder(items, admit, head, tail) -> Callable[[int], str]:
    def build(n: int) -> str:
        chosen = [w for i, (w, is_common) in enumerate(items) if is_common or admit[i] < n]
        listing = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(chosen))
        return f"{head}\n\n{listing}\n\n{tail}"

    return build


def common_words(rng, target_len, count, haystack, *, num_common: int = 10,
                 rare_freq: int = 2) -> Example:
    """Common-word extraction: a numbered word list where ``num_common`` words appear
    ``common_freq`` times (``target_len // 200`` clipped to [rare_freq + 2, 30]) and the others
    ``rare_freq`` times; when the haystack has too few distinct words for the length, the rare
    frequency is raised (up to ``common_freq - 2``)."""
    if num_common < 1 or rare_freq < 1:
        raise ValueError(f"num_common and rare_freq must be >= 1, got {num_common}, {rare_freq}")
    pool = list(haystack.words())
    rng.shuffle(pool)
    if len(pool) < num_common + 1:
        raise LengthError(f"haystack {haystack.name!r} has too few distinct words for common_words")
    common, rare = pool[:num_common], pool[num_common:]
    # Every list item ("N. word" + newline) measures at least 2 units, so more rare words than
    # this can never fit; capping keeps long pools cheap.
    rare = rare[: target_len // (2 * rare_freq) + 2]
    rank = {w: i for i, w in enumerate(rare)}
    head = "Below is a numbered list of words. Some words appear more often than others."
    tail = (f"What are the {num_common} most common words in the list above?\n"
            f"Answer: The {num_common} most common words are")
    order_seed = rng.random()
    freq = rare_freq
    while True:
        common_freq = max(freq + 2, min(30, target_len // 200))
        # One fixed order over all candidate items; a prompt with n rare words keeps their order.
        items = [(w, True) for w in common for _ in range(common_freq)]
        items += [(w, False) for w in rare for _ in range(freq)]
        random.Random(order_seed).shuffle(items)
        # Rare items are admitted by rank (word rank, then occurrence), one item at a time, so the
        # length is met to within one list item; a rare word may then appear fewer than ``freq`` times.
        order = sorted(range(len(items)), key=lambda i: (items[i][1], rank.get(items[i][0], 0), i))
        admit = {i: k for k, i in enumerate(j for j in order if not items[j][1])}

        build = _word_list_builder(items, admit, head, tail)
        try:
            _, prompt, length = fit_length(build, target_len, count, len(admit))
            break
        except LengthError as e:
            if "not enough filler" not in str(e) or freq + 2 >= 30:
                raise LengthError(f"common_words at length {target_len}: {e}") from e
            freq += 1
    return Example("common_words", prompt, tuple(common), target_len, length,
                   {"haystack": haystack.name, "common_freq": common_freq, "rare_freq": freq})


TASKS: dict[str, Callable[..., Example]] = {
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
}


def example_rng(task: str, seed: int, length: int, index: int) -> random.Random:
    """The per-example RNG: a ``random.Random`` seeded by a string (stable across Python versions)."""
    return random.Random(f"minimax-ruler:{task}:{seed}:{length}:{index}")


def generate(task: str, target_len: int, count: CountFn, haystack: Haystack, *, seed: int = 0,
             index: int = 0, **params) -> Example:
    """One example of ``task`` (see :data:`TASKS`), deterministic in (task, seed, length, index).

    Raises:
      KeyError: unknown task (the message lists the known ones); LengthError: length not reachable.
    """
    if task not in TASKS:
        raise KeyError(f"unknown task {task!r}; known tasks: {sorted(TASKS)}")
    if target_len < 1:
        raise ValueError(f"target length must be positive, got {target_len}")
    ex = TASKS[task](example_rng(task, seed, target_len, index), target_len, count, haystack, **params)
    return dataclasses.replace(ex, metadata=dict(ex.metadata, seed=seed, index=index))


def generate_suite(tasks: Sequence[str], lengths: Sequence[int], num_samples: int, count: CountFn,
                   haystack: Haystack, *, seed: int = 0) -> list[Example]:
    """``num_samples`` examples per (task, length). ``niah_single`` depths are evenly spaced in
    [0, 1] over the samples (one sample: depth 0.5); other tasks draw their depths from the seed."""
    out = []
    for task in tasks:
        for length in lengths:
            for i in range(num_samples):
                params = {}
                if task == "niah_single":
                    params["depth"] = 0.5 if num_samples == 1 else i / (num_samples - 1)
                out.append(generate(task, length, count, haystack, seed=seed, index=i, **params))
    return out
