"""Cycle times along one long generation, in scale mode, run twice in one process.

    python scripts/cycle_series.py [--scale qwen3.5-9b] [--tokens 1024] [--replay-mean 6.5] [--runs 2]

A replay bench at Qwen3.5-9B's shape ran its cycles at ~28 ms in a 1,024-token text and ~19 ms
in a 4,096-token one (H200, eighteenth session), against ~17 ms from the per-part costs
(``--costs-only``). This prints, per 256 positions of context, mlx-lm's ms a token and DFlash's
ms a cycle, for each run of the same text: a cost paid once per new context size shows up in the
first run only; one paid per text, in every run's first rows. ``--warm-tokens N`` first runs
both on another prompt for N tokens (the bench's warm-up reaches ~300), so that the first run
shows what a bench's timed text pays past it; each run also lists its slowest cycles.
"""

import argparse
import time
from collections import defaultdict

import mlx.core as mx
from mlx_lm.generate import stream_generate as mlx_lm_stream

from mlx_dflash.engine import DFlashProposer, stream_generate
from mlx_dflash.replay import ReplayProposer, geometric_schedule
from mlx_dflash.scale import null_tokenizer, random_draft, random_target

parser = argparse.ArgumentParser()
parser.add_argument("--scale", default="qwen3.5-9b")
parser.add_argument("--tokens", type=int, default=1024)
parser.add_argument("--prompt-len", type=int, default=128)
parser.add_argument("--replay-mean", type=float, default=6.5)
parser.add_argument("--runs", type=int, default=2)
parser.add_argument("--warm-tokens", type=int, default=0)
args = parser.parse_args()

model, config = random_target(args.scale)
tokenizer = null_tokenizer(config["vocab_size"])
draft = random_draft(config)
prompt = mx.random.randint(0, config["vocab_size"], (args.prompt_len,), key=mx.random.key(0)).tolist()


def series(stream, tokens_of) -> tuple[dict, list[int], list[tuple[float, int]]]:
    """ms per item of the stream by 256-position bucket of context (mean, count, slowest; the
    first item, which holds the prefill, is left out), the tokens, and the 8 slowest items (ms, context)."""
    spent, count, slowest, tokens = defaultdict(float), defaultdict(int), defaultdict(float), []
    items = []  # (ms, context) of each item
    tic = None
    for response in stream:
        now = time.perf_counter()
        if tic is not None:
            bucket = (args.prompt_len + len(tokens)) // 256 * 256
            spent[bucket] += now - tic
            count[bucket] += 1
            slowest[bucket] = max(slowest[bucket], now - tic)
            items.append((1000 * (now - tic), args.prompt_len + len(tokens)))
        tokens += tokens_of(response)
        tic = now
    by_bucket = {b: (1000 * spent[b] / count[b], count[b], 1000 * slowest[b]) for b in sorted(spent)}
    return by_bucket, tokens, sorted(items, reverse=True)[:8]


def replay_of(prompt: list[int], reference: list[int]) -> ReplayProposer:
    return ReplayProposer(prompt + reference, draft.block_size, geometric_schedule(args.replay_mean, draft.block_size),
                          config["vocab_size"], cost_of=DFlashProposer(draft))


if args.warm_tokens:
    other = mx.random.randint(0, config["vocab_size"], (args.prompt_len,), key=mx.random.key(1)).tolist()
    warm = [r.token for r in mlx_lm_stream(model, tokenizer, mx.array(other), max_tokens=args.warm_tokens)]
    for _ in stream_generate(model, tokenizer, other, replay_of(other, warm), max_tokens=args.warm_tokens):
        pass


for run in range(args.runs):
    base, reference, _ = series(mlx_lm_stream(model, tokenizer, mx.array(prompt), max_tokens=args.tokens),
                                lambda r: [r.token])
    tic = time.perf_counter()
    cycles, tokens, slowest_cycles = series(stream_generate(model, tokenizer, prompt, replay_of(prompt, reference),
                                                            max_tokens=args.tokens), lambda r: r.tokens)
    total = time.perf_counter() - tic
    print(f"run {run}: DFlash {len(tokens)} tokens in {total:.2f} s, equal to mlx-lm's: {tokens == reference}")
    for bucket in cycles:
        ms, n, slowest = cycles[bucket]
        step, _, step_slowest = base.get(bucket, (float("nan"), 0, float("nan")))
        print(f"  context {bucket:5d}+: mlx-lm {step:6.2f} ms/token (slowest {step_slowest:6.1f}) | "
              f"DFlash {ms:6.2f} ms/cycle over {n:3d} cycles (slowest {slowest:6.1f})")
    print("  slowest cycles (ms at context):", ", ".join(f"{ms:.1f} at {at}" for ms, at in slowest_cycles))
