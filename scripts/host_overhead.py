"""Host time per decoding step: the engine's plain path against mlx-lm's, side by side.

    python scripts/host_overhead.py [--tokens 512] [--rounds 3]

A random llama with SmolLM2-135M's depth (30 layers) but tiny widths (scale mode's shape
"deep-thin"), so that a step's arithmetic is negligible and what is left is per-step host work: building the graph,
dispatching kernels, the engine's bookkeeping. That is the regime of a small model on a
GPU (an H200 decodes SmolLM2-135M in ~4 ms, launch-bound), where the random-draft floor
measured 0.86x: the adaptive policy settles on plain steps, so they must cost what
mlx-lm's do. Methods per round, alternating: mlx-lm's stream_generate, DFlash with
block size 1 (plain steps only), DFlash adaptive with a random draft.
"""

import argparse

import mlx.core as mx

from mlx_dflash import generate
from mlx_dflash.bench import run_mlx_lm
from mlx_dflash.draft import create_random_draft
from mlx_dflash.scale import null_tokenizer, random_target

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=512)
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()

mx.random.seed(0)
model, config = random_target("deep-thin")
model.set_dtype(mx.float32)  # random_target builds bfloat16; the CPU's fast path is float32
mx.eval(model.parameters())
tokenizer = null_tokenizer(config["vocab_size"])
draft = create_random_draft(config, num_layers=5, block_size=16, mask_token_id=config["vocab_size"] - 1)
prompt = list(range(1, 33))

methods = {
    "mlx-lm": lambda: run_mlx_lm(model, tokenizer, prompt, args.tokens)[2],
    "dflash, block 1": lambda: generate(model, tokenizer, prompt, draft, max_tokens=args.tokens,
                                        block_size=1).decode_seconds,
    "dflash adaptive, random draft": lambda: generate(model, tokenizer, prompt, draft, max_tokens=args.tokens,
                                                      adaptive=True).decode_seconds,
}
for run in methods.values():  # warm-up
    run()
for round_index in range(args.rounds):
    ms = {name: 1000 * run() / (args.tokens - 1) for name, run in methods.items()}
    base = ms["mlx-lm"]
    print(f"round {round_index}: " + ", ".join(f"{name} {v:.3f} ms/token ({base / v:.3f}x)" for name, v in ms.items()),
          flush=True)
