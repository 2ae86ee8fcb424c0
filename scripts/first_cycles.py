"""What a text's first cycles cost next to its steady ones: the wall time of each cycle of DFlash
generations, one per prompt, each prompt new to the process (a new length: on MLX's CUDA backend
new shapes cost host time).

    python scripts/first_cycles.py [--model M] [--draft D] [--prompts P.jsonl] [--num-prompts 6] [--tokens 256]
                                   [--block-size 16]

Per prompt: the prefill (to the first token), the first and the last cycle together, and the
median of the cycles between them, in ms; "extra" is what the first and last cost beyond two
steady ones; "slowest" the three slowest cycles between them (cycle: ms), where a buffer's growth
(every 256 positions) or a new compiled trace would show. (Each cycle's time holds the next cycle's launch, made before its tokens are handed
out: the first one's time holds two launches, the last one's none; so the two are read together.)
One warm-up generation on a prompt not measured comes first (kernels, traces, allocator).
"""

import argparse
import statistics
import time

from mlx_dflash import stream_generate
from mlx_dflash.bench import humaneval_prompts
from mlx_dflash.data import encode_chat, read_prompts
from mlx_dflash.draft import load_draft
from mlx_dflash.models import DEFAULT_MODEL, shipped_draft
from mlx_dflash.target import float_dtype, load_target

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=DEFAULT_MODEL)
parser.add_argument("--draft", default=None, help="default: the draft shipped for --model")
parser.add_argument("--prompts", default=None, help="JSONL prompts (default: the bench's HumanEval set)")
parser.add_argument("--num-prompts", type=int, default=6)
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--block-size", type=int, default=None)
args = parser.parse_args()

model, tokenizer = load_target(args.model)
draft = load_draft(args.draft or shipped_draft(args.model), dtype=float_dtype(model))
texts = read_prompts(args.prompts) if args.prompts else humaneval_prompts()
prompts = [encode_chat(tokenizer, text) for text in texts[: args.num_prompts + 1]]


def cycle_times(prompt: list[int]) -> list[float]:
    """Seconds from the call to the first token, then between the cycles' outputs."""
    marks = [time.perf_counter()]
    for _ in stream_generate(model, tokenizer, prompt, draft, max_tokens=args.tokens, block_size=args.block_size):
        marks.append(time.perf_counter())
    return [b - a for a, b in zip(marks, marks[1:])]


cycle_times(prompts[-1])  # warm-up
print(f"{'prompt':>6} {'tokens':>6} {'cycles':>6} {'prefill':>8} {'ends':>8} {'steady':>8} {'extra':>8} (ms)  slowest")
for index, prompt in enumerate(prompts[:-1]):
    times = [1000 * t for t in cycle_times(prompt)]
    if len(times) < 5:
        print(f"{index:6d}: too few cycles ({len(times) - 1})")
        continue
    ends, steady = times[1] + times[-1], statistics.median(times[2:-1])
    slowest = sorted(range(2, len(times) - 1), key=lambda i: -times[i])[:3]
    print(f"{index:6d} {len(prompt):6d} {len(times) - 1:6d} {times[0]:8.2f} {ends:8.2f} {steady:8.2f} "
          f"{ends - 2 * steady:8.2f}  " + ", ".join(f"{i}: {times[i]:.1f}" for i in slowest), flush=True)
