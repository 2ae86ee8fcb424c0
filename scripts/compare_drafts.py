"""Two drafts for the same target, side by side, alternating in one process (run with PYTHONPATH=src)

    python scripts/compare_drafts.py DRAFT_A DRAFT_B [--model M] [--num-prompts 4] [--tokens 256] [--rounds 2]

For each round and HumanEval prompt (chat template, EOS on): mlx-lm greedy, then each draft
with 16-token blocks and adaptive, one after the other, so that a shared machine's drift
hits every method alike. Prints decode tok/s (tokens over decode seconds, summed per method
and round), the ratio to mlx-lm and the mean acceptance length, and checks every output
equals mlx-lm's. Use it to measure a change to a draft (its vocabulary, quantization).
On Linux CPUs run it with the OpenBLAS LD_PRELOAD that `mlx-dflash doctor` prints.
"""

import argparse
from collections import defaultdict

from mlx_dflash import generate, load_draft, load_target
from mlx_dflash.bench import humaneval_prompts, run_mlx_lm
from mlx_dflash.data import encode_chat
from mlx_dflash.models import DEFAULT_MODEL
from mlx_dflash.target import float_dtype

parser = argparse.ArgumentParser()
parser.add_argument("drafts", nargs=2)
parser.add_argument("--model", default=DEFAULT_MODEL)
parser.add_argument("--num-prompts", type=int, default=4)
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--rounds", type=int, default=2)
args = parser.parse_args()

model, tok = load_target(args.model)
drafts = {name: load_draft(name, dtype=float_dtype(model)) for name in args.drafts}
prompts = [encode_chat(tok, p) for p in humaneval_prompts()[: args.num_prompts]]
for draft in drafts.values():  # warm-up: first uses of every shape
    generate(model, tok, prompts[0], draft, max_tokens=64)
    generate(model, tok, prompts[0], draft, max_tokens=64, adaptive=True)

for round_index in range(args.rounds):
    tokens, seconds, accepted = defaultdict(int), defaultdict(float), defaultdict(list)
    for prompt in prompts:
        reference, _, decode_s, _ = run_mlx_lm(model, tok, prompt, args.tokens)
        tokens["mlx-lm"] += len(reference) - 1  # as for DFlash: the prefill's token is not decoded
        seconds["mlx-lm"] += decode_s
        for name, draft in drafts.items():
            for adaptive in (False, True):
                method = f"{name} {'adaptive' if adaptive else 'block 16'}"
                result = generate(model, tok, prompt, draft, max_tokens=args.tokens, adaptive=adaptive)
                if result.tokens != reference:
                    print(f"  MISMATCH: {method} differs from mlx-lm")
                tokens[method] += len(result.tokens) - 1
                seconds[method] += result.decode_seconds
                accepted[method] += result.acceptance_lengths
    base = tokens["mlx-lm"] / seconds["mlx-lm"]
    print(f"round {round_index}: mlx-lm {base:.2f} tok/s")
    for method in tokens:
        if method != "mlx-lm":
            rate = tokens[method] / seconds[method]
            mean = sum(accepted[method]) / max(len(accepted[method]), 1)
            print(f"  {method}: {rate:.2f} tok/s ({rate / base:.3f}x), mean acceptance {mean:.2f}", flush=True)
