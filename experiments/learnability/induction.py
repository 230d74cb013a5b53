"""Induction (copy) checks, CPU-sized (RESULTS.md, run 3 findings).

    python experiments/learnability/induction.py repeat --checkpoint checkpoints/demo
        loss per token on 200-token Shakespeare passages and on the same passage repeated right
        after it; a model with induction heads gets a much lower loss on the repeat.
    python experiments/learnability/induction.py train [--steps 400] [--set key=value ...]
        trains configs/demo-m3.yaml shrunk to 2 full-attention layers (vocab 512, fp32) on random
        48-token sequences repeated once, printing the repeat's loss every 100 steps: can this
        architecture learn to copy at all?
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from minimax_jax.config import ModelConfig
from minimax_jax.model.params import init_params
from minimax_jax.model.transformer import forward


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


def train_copy(steps: int, overrides: dict, seq: int = 48, batch: int = 32, lr: float = 3e-3, log=print,
               optimizer: str = "adamw", log_every: int = 100, seed: int = 0) -> list[float]:
    """Train the shrunk demo config on repeated random sequences; returns the repeat NLL logged every
    ``log_every`` steps (the model config starts from configs/demo-m3.yaml cut to 2 dense
    full-attention layers, vocab 512, fp32, then ``overrides``)."""
    base = yaml.safe_load(open("configs/demo-m3.yaml"))["model"]
    base.update(num_layers=2, layer_types=["full", "full"], mlp_types=["dense", "dense"], num_mtp_modules=0,
                vocab_size=512, dtype="float32")
    base.update(overrides)
    cfg = ModelConfig(**base)
    params = init_params(cfg, jax.random.PRNGKey(0))
    opt = make_optimizer(optimizer, lr, steps)
    state = opt.init(params)

    @jax.jit
    def step(p, st, toks):
        def loss(p):
            nll = token_nll(p, cfg, toks)
            return nll.mean(), nll[:, seq + 4:].mean()
        (_, rep), g = jax.value_and_grad(loss, has_aux=True)(p)
        u, st = opt.update(g, st, p)
        return optax.apply_updates(p, u), st, rep

    rng = np.random.default_rng(seed)
    t0, curve = time.time(), []
    for i in range(steps + 1):
        s = rng.integers(3, cfg.vocab_size, size=(batch, seq))
        toks = jnp.asarray(np.concatenate([np.ones((batch, 1), int), s, s], 1), jnp.int32)
        params, state, rep = step(params, state, toks)
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
    t.add_argument("--steps", type=int, default=400)
    t.add_argument("--set", action="append", default=[], help="model config override key=value")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--optimizer", default="adamw", choices=["adamw", "train"])
    t.add_argument("--seq", type=int, default=48)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--log_every", type=int, default=100)
    a = ap.parse_args()
    if a.cmd == "repeat":
        first, second = repeat_check(a.checkpoint)
        print(f"{a.checkpoint}: first copy NLL {first:.3f}, repeat NLL {second:.3f}")
    else:
        train_copy(a.steps, {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in a.set)}, seq=a.seq,
                   batch=a.batch, lr=a.lr, optimizer=a.optimizer, log_every=a.log_every)


if __name__ == "__main__":
    main()
