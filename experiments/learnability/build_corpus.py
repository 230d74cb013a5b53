"""Retrieval-only training documents for the CPU learnability check (RESULTS.md, "After run 2").

    python experiments/learnability/build_corpus.py OUT_DIR N_DOCS MIN_CHARS MAX_CHARS [tasks]

Writes OUT_DIR/train-00000.jsonl: N_DOCS documents of ``minimax_jax.data.retrieval.make_document``
("dense" mode: a haystack of training Shakespeare with needles, then a question + answer for every
needle, in the eval prompts' wording), tasks taken in turn (default niah_single,niah_multikey),
shuffled with seed 0. Prints the document count, mean length in characters and supervised answers.
"""

import json
import os
import random
import sys

from minimax_jax.data.corpus import prose_documents
from minimax_jax.data.retrieval import make_document
from minimax_jax.data.haystack import Haystack


def main(argv):
    out, n, min_chars, max_chars = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    tasks = argv[4].split(",") if len(argv) > 4 else ["niah_single", "niah_multikey"]
    train, _ = prose_documents(0, 4)     # the corpus builder's training works (4 held out)
    hay = Haystack("\n\n".join(d["text"] for d in sorted(train, key=lambda d: d["id"])), name="shakespeare-train")
    docs, i = [], 0
    while len(docs) < n:
        d = make_document(tasks[i % len(tasks)], i, hay, seed=0, min_chars=min_chars, max_chars=max_chars, mode="dense")
        i += 1
        if d:
            docs.append(d)
    random.Random(0).shuffle(docs)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "train-00000.jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    print(len(docs), sum(len(d["text"]) for d in docs) / len(docs), sum(d["answers"] for d in docs))


if __name__ == "__main__":
    main(sys.argv[1:])
