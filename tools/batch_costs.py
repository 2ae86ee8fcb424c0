"""The batch decoder alone (no server): decode speed and cost of a cycle at several row counts,
each cycle queued before the previous one is read (``EngineOptions.queue_ahead``) or not.

    python tools/batch_costs.py [--model M] [--draft D] [--rows 1 8 16] [--max-tokens 256] [--repeats 2]

The first R HumanEval prompts as chat prompts join before the first cycle and decode greedily
in fixed full blocks, each to ``--max-tokens`` (the decoder stops rows at their max_tokens
only, so there are R rows all along). Per row count and way, alternating, the best of
``--repeats``: decode tok/s over all rows (prefills excluded), ms per cycle and tokens
committed per row and cycle; and whether both ways gave every row the same tokens. Then what a
join costs there: 8 more prompts, one at a time, each prefilled alone and merged into R - 1
decoding rows (cycles queued ahead: the one queued is read first), median ms.
"""

import argparse
import statistics
import time

import mlx.core as mx

from mlx_dflash import load, use_fast_blas
from mlx_dflash.batch import BatchDecoder
from mlx_dflash.bench import humaneval_prompts
from mlx_dflash.generate import encode_prompt
from mlx_dflash.options import EngineOptions

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
parser.add_argument("--draft", default=None, help="default: the draft shipped for the model")
parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
parser.add_argument("--max-tokens", type=int, default=256)
parser.add_argument("--repeats", type=int, default=2)
args = parser.parse_args()

use_fast_blas()
model, tokenizer, draft = load(args.model, args.draft)
JOINS = 8
prompts = [encode_prompt(tokenizer, text, chat=True) for text in humaneval_prompts()[: max(args.rows) + JOINS]]
WAYS = {"read each cycle": EngineOptions(queue_ahead=False), "queued ahead": EngineOptions(queue_ahead=True)}


def decode(decoder: BatchDecoder, rows: int) -> tuple[float, int, list[list[int]]]:
    """(decode seconds, cycles, every row's tokens)."""
    outputs = {}
    for prompt in prompts[:rows]:
        row = decoder.add(prompt, args.max_tokens)
        outputs[row.id] = list(row.tokens)
    mx.synchronize()
    tic, cycles = time.perf_counter(), 0
    while decoder.rows:
        for row, tokens in decoder.step().items():
            outputs[row] += tokens
        cycles += 1
    return time.perf_counter() - tic, cycles, list(outputs.values())


def join_seconds(decoder: BatchDecoder, rows: int) -> list[float]:
    """Seconds of each of ``JOINS`` joins into ``rows - 1`` rows that are decoding."""
    for prompt in prompts[: rows - 1]:
        decoder.add(prompt, args.max_tokens)
    seconds = []
    for prompt in prompts[-JOINS:]:
        decoder.step()
        decoder.step()  # (a cycle queued again)
        mx.synchronize()
        tic = time.perf_counter()
        row = decoder.add(prompt, args.max_tokens)
        mx.synchronize()
        seconds.append(time.perf_counter() - tic)
        decoder.remove(row.id)
    decoder.clear()
    return seconds


print("| rows | way | decode tok/s | ms a cycle | tokens a row and cycle |\n|---|---|---|---|---|")
for rows in args.rows:
    decoders = {way: BatchDecoder(model, draft, options=options) for way, options in WAYS.items()}
    for decoder in decoders.values():
        decode(decoder, rows)  # (its kernels built, its traces made)
    best, texts = {}, {}
    for _ in range(args.repeats):
        for way, decoder in decoders.items():
            seconds, cycles, outputs = decode(decoder, rows)
            tokens = sum(len(t) - 1 for t in outputs)
            if way not in best or seconds < best[way][0]:
                best[way] = (seconds, cycles, tokens)
            texts[way] = outputs
    for way, (seconds, cycles, tokens) in best.items():
        print(f"| {rows} | {way} | {tokens / seconds:.1f} | {1e3 * seconds / cycles:.2f} | {tokens / rows / cycles:.2f} |")
    print(f"(rows={rows}: both ways gave the same tokens: {len({str(t) for t in texts.values()}) == 1})")
    joiner = decoders["queued ahead"]
    join_seconds(joiner, rows)  # (its prefill shapes built)
    print(f"(rows={rows}: a join takes {1e3 * statistics.median(join_seconds(joiner, rows)):.2f} ms, median of {JOINS})")
