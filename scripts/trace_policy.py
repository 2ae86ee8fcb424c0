"""What does the adaptive policy do, cycle by cycle? (run with PYTHONPATH=src)

    python scripts/trace_policy.py DRAFT [--tokens 256]

Runs adaptive DFlash and mlx-lm greedy twice on HumanEval prompt 2 (EOS off) with the
embedded model, and prints every cycle that was not plain decoding (block size,
acceptance, ms) and the total time of plain and non-plain cycles: the exploration and
probe cost that a poor draft adds. On Linux CPUs use the OpenBLAS LD_PRELOAD that
`mlx-dflash doctor` prints.
"""

import argparse

import mlx.core as mx

from mlx_dflash import engine, generate, load_draft, load_target
from mlx_dflash.policy import BlockPolicy
from mlx_dflash.bench import humaneval_prompts, run_mlx_lm
from mlx_dflash.data import encode_chat
from mlx_dflash.models import DEFAULT_MODEL
from mlx_dflash.target import float_dtype

parser = argparse.ArgumentParser()
parser.add_argument("draft")
parser.add_argument("--tokens", type=int, default=256)
args = parser.parse_args()

model, tok = load_target(DEFAULT_MODEL)
draft = load_draft(args.draft, dtype=float_dtype(model))
tok.eos_token_ids = set()
cycles: list[tuple[int, int, int]] = []


class TracedPolicy(BlockPolicy):
    def record(self, block: int, acceptance: int, seconds: float) -> None:
        cycles.append((block, acceptance, round(seconds * 1000)))
        super().record(block, acceptance, seconds)


engine.BlockPolicy = TracedPolicy  # this script only: the engine builds its policy from this name
prompt = encode_chat(tok, humaneval_prompts()[1])
run_mlx_lm(model, tok, prompt, 64)
generate(model, tok, prompt, draft, max_tokens=64, adaptive=True)  # warm-up
for _ in range(2):
    cycles.clear()
    result = generate(model, tok, prompt, draft, max_tokens=args.tokens, adaptive=True)
    tokens, _, decode_s, _ = run_mlx_lm(model, tok, prompt, args.tokens)
    print(f"adaptive {args.tokens / result.decode_seconds:.2f} tok/s, mlx-lm {len(tokens) / decode_s:.2f} tok/s")
    others = [c for c in cycles if c[0] > 1]
    plain = [c[2] for c in cycles if c[0] == 1]
    print(f"  non-plain cycles (block, a+1, ms): {others}")
    print(f"  plain: {len(plain)} cycles, median {sorted(plain)[len(plain) // 2]} ms, {sum(plain)} ms in all; "
          f"non-plain {sum(c[2] for c in others)} ms in all")
