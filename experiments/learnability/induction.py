"""Induction (copy) checks, CPU-sized (RESULTS.md, run 3 findings).

    python experiments/learnability/induction.py repeat --checkpoint checkpoints/demo
        loss per token on 200-token Shakespeare passages and on the same passage repeated right
        after it; a model with induction heads gets a much lower loss on the repeat.
    python experiments/learnability/induction.py train [--steps 400] [--set key=value ...]
        trains configs/demo-m3.yaml shrunk to 2 full-attention layers (vocab 512, fp32) on random
        48-token sequences repeated once, printing the repeat's loss every 100 steps: can this
        architecture learn to copy at all?
        ``--offset random`` (session 7): rows of 2 x seq + 32 random tokens in which ONE span of 10 to
        seq tokens is repeated at a random later place. With ``--offset fixed`` (the default, every
        row = one sequence shown twice) the copy is always ``seq`` tokens back, which a single
        position-based attention head solves; a random offset needs a real induction circuit
        (previous-token head + content match, Olsson et al. 2022), what copying real text needs.
        The printed loss is then over the span's repeat minus its first token.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from minimax_jax.config import ModelConfig
from minimax_jax.model.params import init_params
from minimax_jax.model.transformer import forward

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def token_nll(params, cfg, toks):
    """Per-position next-token NLL ``[B, T-1]`` (float32) of ``toks`` ``[B, T]`` int32."""
    lp = jax.nn.log_softmax(forward(params, cfg, toks).logits[:, :-1], -1)
    return -jnp.take_along_axis(lp, toks[:, 1:, None], -1)[..., 0]


def repeat_check(checkpoint: str, n: int = 200, rows: int = 4) -> tuple[float, float]:
    """(first-copy, second-copy) mean NLL of ``rows`` Shakespeare passages of ``n`` tokens."""
    from minimax_jax.data.prose import shakespeare_files
    from minimax_jax.infer.loading import load_model

    m = load_model(checkpoint)
    ids = m.tokenizer.encode(open(shakespeare_files()[5], errors="ignore").read()[20000:80000]).ids
    if len(ids) < rows * (n + 100):
        raise ValueError("passage too short for the requested rows")
    toks = np.array([[m.cfg.bos_token_id] + ids[i * (n + 100):i * (n + 100) + n] * 2 for i in range(rows)], np.int32)
    nll = np.asarray(token_nll(m.params, m.cfg, jnp.asarray(toks)))
    return float(nll[:, 10:n].mean()), float(nll[:, n + 10:].mean())


def make_optimizer(kind: str, lr: float, steps: int) -> optax.GradientTransformation:
    """``adamw``: plain AdamW at a constant ``lr``; ``train``: train.py's recipe (global-norm clip 1,
    AdamW b2 0.95, weight decay 0.1, 5% linear warm-up then cosine decay to 10%)."""
    if kind == "adamw":
        return optax.adamw(lr)
    if kind == "train":
        sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), max(2, steps), lr * 0.1)
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b2=0.95, weight_decay=0.1))
    raise ValueError(f"unknown optimizer {kind!r} (adamw, train)")


def copy_batch(rng: np.random.Generator, vocab: int, batch: int, seq: int, offset: str) -> tuple[np.ndarray, np.ndarray]:
    """Token rows int32 ``[batch, T]`` (BOS = 1 first) and the float32 ``[batch, T - 1]`` mask of the
    next-token targets a copying model can predict (see the module docstring for ``offset``)."""
    if offset == "fixed":
        s = rng.integers(3, vocab, size=(batch, seq))
        toks = np.concatenate([np.ones((batch, 1), int), s, s], 1)
        mask = np.zeros((batch, 2 * seq), np.float32)
        mask[:, seq + 4:] = 1.0                 # as before: the repeat after its first few tokens
        return toks.astype(np.int32), mask
    t = 2 * seq + 32
    toks = rng.integers(3, vocab, size=(batch, t + 1))
    toks[:, 0] = 1
    mask = np.zeros((batch, t), np.float32)
    for b in range(batch):
        n = int(rng.integers(10, seq + 1))
        a = int(rng.integers(1, t + 1 - 2 * n))
        c = int(rng.integers(a + n, t + 1 - n))    # the repeat starts at c >= a + n
        toks[b, c:c + n] = toks[b, a:a + n]
        mask[b, c:c + n - 1] = 1.0              # target index i predicts token i + 1
    return toks.astype(np.int32), mask


def train_copy(steps: int, overrides: dict, seq: int = 48, batch: int = 32, lr: float = 3e-3, log=print,
               optimizer: str = "adamw", log_every: int = 100, seed: int = 0, offset: str = "fixed",
               layers: int = 2) -> list[float]:
    """Train the shrunk demo config on repeated random sequences; returns the repeat NLL logged every
    ``log_every`` steps (the model config starts from configs/demo-m3.yaml cut to 2 dense
    full-attention layers, vocab 512, fp32, then ``overrides``)."""
    base = yaml.safe_load(open(os.path.join(ROOT, "configs", "demo-m3.yaml")))["model"]
    if offset not in ("fixed", "random"):
        raise ValueError(f"offset must be fixed or random, got {offset!r}")
    if offset == "random" and seq < 10:
        raise ValueError(f"--offset random hides spans of 10 to seq tokens: seq must be >= 10, got {seq}")
    base.update(num_layers=layers, layer_types=["full"] * layers, mlp_types=["dense"] * layers, num_mtp_modules=0,
                vocab_size=512, dtype="float32")
    unknown = sorted(set(overrides) - set(ModelConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"--set: unknown model config keys {unknown}")
    base.update(overrides)
    cfg = ModelConfig(**base)
    if cfg.vocab_size <= 4:
        raise ValueError(f"vocab_size must be > 4 (ids 0-2 are special), got {cfg.vocab_size}")
    params = init_params(cfg, jax.random.PRNGKey(0))
    opt = make_optimizer(optimizer, lr, steps)
    state = opt.init(params)

    @jax.jit
    def step(p, st, toks, rep_mask):
        def loss(p):
            nll = token_nll(p, cfg, toks)
            return nll.mean(), jnp.sum(nll * rep_mask) / jnp.maximum(jnp.sum(rep_mask), 1.0)
        (_, rep), g = jax.value_and_grad(loss, has_aux=True)(p)
        u, st = opt.update(g, st, p)
        return optax.apply_updates(p, u), st, rep

    rng = np.random.default_rng(seed)
    t0, curve = time.time(), []
    for i in range(steps + 1):
        toks, rep_mask = copy_batch(rng, cfg.vocab_size, batch, seq, offset)
        params, state, rep = step(params, state, jnp.asarray(toks), jnp.asarray(rep_mask))
        if i % log_every == 0:
            curve.append(float(rep))
            log(f"step {i}: repeat NLL {float(rep):.3f} ({time.time() - t0:.0f} s)")
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("repeat")
    r.add_argument("--checkpoint", default="checkpoints/demo")
    t = sub.add_parser("train")
    t.add_argument("--steps", type=int, default=400, help="the loss is logged after updates 0, log_every, ..., "
                   "steps (steps + 1 updates)")
    t.add_argument("--set", action="append", default=[], help="model config override key=value")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--optimizer", default="adamw", choices=["adamw", "train"])
    t.add_argument("--seq", type=int, default=48)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--log_every", type=int, default=100)
    t.add_argument("--offset", default="fixed", choices=["fixed", "random"])
    t.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    if a.cmd == "repeat":
        first, second = repeat_check(a.checkpoint)
        print(f"{a.checkpoint}: first copy NLL {first:.3f}, repeat NLL {second:.3f}")
    else:
        bad = [s for s in a.set if "=" not in s]
        if bad:
            ap.error(f"--set needs key=value, got {bad}")
        train_copy(a.steps, {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in a.set)}, seq=a.seq,
                   batch=a.batch, lr=a.lr, optimizer=a.optimizer, log_every=a.log_every, offset=a.offset,
                   layers=a.layers)


if __name__ == "__main__":
    main()
