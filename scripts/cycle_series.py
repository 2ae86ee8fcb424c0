"""Cycle times along one long generation, in scale mode, run twice in one process.

    python scripts/cycle_series.py [--scale qwen3.5-9b] [--tokens 1024] [--replay-mean 6.5] [--runs 2]

A replay bench at Qwen3.5-9B's shape ran its cycles at ~28 ms in a 1,024-token text and ~19 ms
in a 4,096-token one (H200, eighteenth session), against ~17 ms from the per-part costs
(``--costs-only``). This prints, per 256 positions of context, mlx-lm's ms a token and DFlash's
ms a cycle, for each run of the same text: a cost paid once per new context size shows up in the
first run only; one paid per text, in every run's first rows.
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
args = parser.parse_args()

model, config = random_target(args.scale)
tokenizer = null_tokenizer(config["vocab_size"])
draft = random_draft(config)
prompt = mx.random.randint(0, config["vocab_size"], (args.prompt_len,), key=mx.random.key(0)).tolist()


def series(stream, tokens_of) -> tuple[dict, list[int]]:
    """ms per item of the stream by 256-position bucket of context (the first item, which
    holds the prefill, is left out), and the tokens."""
    spent, count, tokens = defaultdict(float), defaultdict(int), []
    tic = None
    for response in stream:
        now = time.perf_counter()
        if tic is not None:
            bucket = (args.prompt_len + len(tokens)) // 256 * 256
            spent[bucket] += now - tic
            count[bucket] += 1
        tokens += tokens_of(response)
        tic = now
    return {b: (1000 * spent[b] / count[b], count[b]) for b in sorted(spent)}, tokens


for run in range(args.runs):
    base, reference = series(mlx_lm_stream(model, tokenizer, mx.array(prompt), max_tokens=args.tokens),
                             lambda r: [r.token])
    replay = ReplayProposer(prompt + reference, draft.block_size, geometric_schedule(args.replay_mean, draft.block_size),
                            config["vocab_size"], cost_of=DFlashProposer(draft))
    tic = time.perf_counter()
    cycles, tokens = series(stream_generate(model, tokenizer, prompt, replay, max_tokens=args.tokens),
                            lambda r: r.tokens)
    total = time.perf_counter() - tic
    print(f"run {run}: DFlash {len(tokens)} tokens in {total:.2f} s, equal to mlx-lm's: {tokens == reference}")
    for bucket in cycles:
        ms, n = cycles[bucket]
        step = base.get(bucket, (float("nan"), 0))[0]
        print(f"  context {bucket:5d}+: mlx-lm {step:6.2f} ms/token | DFlash {ms:6.2f} ms/cycle over {n:3d} cycles")
