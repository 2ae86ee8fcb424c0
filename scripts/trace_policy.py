"""What does the adaptive policy do, cycle by cycle? (run with PYTHONPATH=src)

    python scripts/trace_policy.py DRAFT [--model smollm2-135m] [--prompts FILE.jsonl]
        [--prompt-index 1 2 ...] [--tokens 256] [--shared-policy]

For each chosen prompt (HumanEval unless --prompts; EOS off), runs adaptive DFlash and mlx-lm greedy (after one
warm-up generation) and prints: both speeds; every cycle that was not plain decoding
(block size, acceptance, ms) when there are few, else a count per block size; the total
time of plain and non-plain cycles (the exploration and probe cost a poor draft adds);
and every slow cycle (over 5x the median of its block size), the trace of a stall.
--shared-policy: one policy for all the prompts (as `serve` and `bench` keep one), not one each.
On Linux CPUs use the OpenBLAS LD_PRELOAD that `mlx-dflash doctor` prints.
"""

import argparse
import statistics
from collections import Counter

from mlx_dflash import generate, load_draft, load_target
from mlx_dflash.bench import humaneval_prompts, run_mlx_lm
from mlx_dflash.data import encode_chat, read_prompts
from mlx_dflash.models import DEFAULT_MODEL
from mlx_dflash.policy import BlockPolicy
from mlx_dflash.target import float_dtype

parser = argparse.ArgumentParser()
parser.add_argument("draft")
parser.add_argument("--model", default=DEFAULT_MODEL)
parser.add_argument("--prompts", default=None, help="a .jsonl of prompts (default: HumanEval)")
parser.add_argument("--prompt-index", type=int, nargs="+", default=[1])
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--shared-policy", action="store_true")
args = parser.parse_args()

model, tok = load_target(args.model)
draft = load_draft(args.draft, dtype=float_dtype(model))
tok.eos_token_ids = set()
texts = read_prompts(args.prompts) if args.prompts else humaneval_prompts()
cycles: list[tuple[object, int, float]] = []  # (block size, or "f" for a plain step with a forecast, a+1, ms)


class TracedPolicy(BlockPolicy):
    def record(self, block: int, acceptance: int, seconds: float, forecast: bool = False) -> None:
        cycles.append(("f" if forecast else block, acceptance, round(seconds * 1000, 1)))
        super().record(block, acceptance, seconds, forecast)


shared = TracedPolicy(draft.block_size) if args.shared_policy else None


def policy() -> TracedPolicy:
    """The shared policy, or a fresh one per generation (what ``adaptive=True`` would build)."""
    return shared or TracedPolicy(draft.block_size)


warmed = False
for index in args.prompt_index:
    prompt = encode_chat(tok, texts[index])
    if not warmed:
        run_mlx_lm(model, tok, prompt, 64)
        generate(model, tok, prompt, draft, max_tokens=64, adaptive=policy())
        warmed = True
    cycles.clear()
    result = generate(model, tok, prompt, draft, max_tokens=args.tokens, adaptive=policy())
    tokens, _, decode_s, _ = run_mlx_lm(model, tok, prompt, args.tokens)
    print(f"prompt {index}: adaptive {args.tokens / result.decode_seconds:.2f} tok/s, "
          f"mlx-lm {len(tokens) / decode_s:.2f} tok/s, mean acceptance {result.mean_acceptance_length:.2f}")
    others = [c for c in cycles if c[0] != 1]
    plain = [c[2] for c in cycles if c[0] == 1]
    if len(others) <= 40:
        print(f"  non-plain cycles (block, a+1, ms): {others}")
    else:
        print(f"  cycles per block size: {dict(sorted(Counter(c[0] for c in cycles).items(), key=str))}")
    if plain:
        print(f"  plain: {len(plain)} cycles, median {statistics.median(plain)} ms, {sum(plain):.0f} ms in all; "
              f"non-plain {sum(c[2] for c in others):.0f} ms in all")
    medians = {b: statistics.median(c[2] for c in cycles if c[0] == b) for b in {c[0] for c in cycles}}
    slow = [(i, *c) for i, c in enumerate(cycles) if c[2] > 5 * medians[c[0]]]
    print(f"  median ms per block size: {dict(sorted(medians.items(), key=str))}")
    print(f"  slow cycles (index, block, a+1, ms): {slow[:30]}; {sum(c[3] for c in slow):.0f} ms in all")
