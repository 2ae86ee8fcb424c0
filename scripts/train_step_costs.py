"""Milliseconds per training step, side by side in one process: float32 passes with the full
head (the old path), the target's dtype with the full head, the target's dtype with a draft
vocabulary (the default path with --draft-vocab). Median of the steps after the first few.

    python scripts/train_step_costs.py --model smollm2-135m --data DIR [DIR ...]
"""

import argparse
import tempfile

import numpy as np

from mlx_dflash.target import load_target
from mlx_dflash.train import TrainConfig, train

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--data", nargs="+", required=True)
parser.add_argument("--steps", type=int, default=14)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--anchors", type=int, default=128)
parser.add_argument("--max-len", type=int, default=768)
args = parser.parse_args()

model, tokenizer = load_target(args.model)
variants = {
    "float32 passes, full head": dict(compute_dtype="float32"),
    "target dtype, full head": dict(),
    "target dtype, 8192-token draft vocabulary": dict(draft_vocab=8192),
}
for label, extra in variants.items():
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, anchors=args.anchors, max_len=args.max_len,
                      eval_every=0, eval_prompts=0, save_every=0, **extra)
    with tempfile.TemporaryDirectory() as out:
        train(model, tokenizer, args.data, out, cfg)
    seconds = np.array([h["seconds"] for h in cfg.history if "loss" in h])
    per_step = np.median(np.diff(seconds)[3:]) * 1000
    print(f"{label}: {per_step:.1f} ms/step ({args.batch_size} x {args.anchors} blocks)", flush=True)
