"""Does running DFlash in a process slow mlx-lm's own decoding in it afterwards?

    python scripts/baseline_interaction.py --model M --draft D [--compile on|off] [--pack on|off]

`mlx-dflash bench` times mlx-lm's greedy and DFlash alternately in one process, on one model
instance. This times mlx-lm alone (after a warm-up) before any DFlash generation, then after
DFlash generations, twice each, with the compiled block forward and the packed projections as
chosen, so that a change that makes the baseline slower cannot pass as a faster ratio. With
``--release`` it then frees what a suspect might hold (Python's garbage, MLX's buffer cache) and
times mlx-lm after each, to find which one the slowdown lives in.
"""

import argparse
import gc

import mlx.core as mx

from mlx_dflash import projections
from mlx_dflash import target as target_module
from mlx_dflash.bench import humaneval_prompts, run_dflash, run_mlx_lm
from mlx_dflash.data import encode_chat, read_prompts
from mlx_dflash.draft import load_draft
from mlx_dflash.engine import DFlashProposer
from mlx_dflash.target import float_dtype, load_target

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--draft", required=True)
parser.add_argument("--compile", choices=["on", "off"], default="on")
parser.add_argument("--pack", choices=["on", "off"], default="on")
parser.add_argument("--tokens", type=int, default=512)
parser.add_argument("--prompts", default=None, help="JSONL prompts (default: the bench's HumanEval set)")
parser.add_argument("--release", action="store_true", help="then gc.collect(), then mx.clear_cache(), timing each")
args = parser.parse_args()
target_module.COMPILE_BLOCKS = args.compile == "on"
projections.PACK_PROJECTIONS = args.pack == "on"

model, tokenizer = load_target(args.model)
draft = load_draft(args.draft, dtype=float_dtype(model))
tokenizer.eos_token_ids = set()
texts = read_prompts(args.prompts) if args.prompts else humaneval_prompts()
prompts = [encode_chat(tokenizer, t) for t in texts[:2]]


def mlx_lm(label):
    for p in prompts:
        tokens, _, decode_s, _ = run_mlx_lm(model, tokenizer, p, args.tokens)
        print(f"{label}: mlx-lm {(len(tokens) - 1) / decode_s:.1f} tok/s", flush=True)


def dflash():  # (not a DFlash speed measurement: its first generations pay one-off costs)
    for p in prompts:
        tokens, _, decode_s, _ = run_dflash(model, tokenizer, p, args.tokens, DFlashProposer(draft), None)
        print(f"  dflash fixed blocks ran ({(len(tokens) - 1) / decode_s:.1f} tok/s, without warm-up)", flush=True)


run_mlx_lm(model, tokenizer, prompts[0], 64)
mlx_lm("before any DFlash")
dflash()
mlx_lm("after DFlash")
dflash()
mlx_lm("after more DFlash")
if args.release:
    memory = lambda: f"active {mx.get_active_memory() / 2**20:.0f} MiB, cache {mx.get_cache_memory() / 2**20:.0f} MiB"  # noqa: E731
    print(f"  gc.collect() found {gc.collect()} objects; {memory()}", flush=True)
    mlx_lm("after gc.collect()")
    mx.clear_cache()
    print(f"  mx.clear_cache(); {memory()}", flush=True)
    mlx_lm("after mx.clear_cache()")
