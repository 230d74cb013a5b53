"""Generate text with a MiniMax-M2 / M3 checkpoint: ``python infer.py --help`` lists every flag.

Examples::

    python infer.py --checkpoint ckpt/ --prompt "Once upon a time" --max_new_tokens 64 --stream
    python infer.py --checkpoint ckpt/ --chat_file chat.json --temperature 0     # tool calls parsed
    python infer.py --checkpoint ckpt/ --context_file book.txt --prompt "Who is it?" --speculative mtp
    python infer.py --prompts_file prompts.jsonl --n 4 --temperature 0.8 --seed 1 --output out.jsonl
    python infer.py --chat_file chat.json --temperature 0 --json --logprobs          # stdout: JSON only
    python infer.py serve --checkpoint ckpt/ --port 8000    # OpenAI-compatible server (minimax_jax.serve)

Thin wrapper; the flags and the logic live in ``minimax_jax.infer.cli`` (``serve``: ``minimax_jax.serve.cli``).
"""

import sys

from minimax_jax.interrupt import exit_while_starting

if __name__ == "__main__":
    serve = sys.argv[1:2] == ["serve"]
    with exit_while_starting("infer.py serve" if serve else "infer.py"):
        import jax  # noqa: F401  (the slow import a Ctrl-C must not be lost in)
        if serve:
            from minimax_jax.serve import cli as serve_cli       # only when serving: fastapi / uvicorn
        else:
            from minimax_jax.infer import cli
    sys.exit(serve_cli.main(sys.argv[2:], prog="infer.py serve") if serve else cli.main())
