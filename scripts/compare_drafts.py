"""Drafts (or block sizes) for the same target, side by side, alternating in one process (run
with PYTHONPATH=src)

    python scripts/compare_drafts.py DRAFT [DRAFT ...] [--model M] [--num-prompts 4] [--tokens 256]
        [--rounds 2] [--block-sizes 16] [--shared-policy] [--eager-blocks]

For each round and HumanEval prompt (chat template, EOS on): mlx-lm greedy, then each draft
with fixed blocks of each size and adaptive, one after the other, so that a shared machine's
drift hits every method alike (separate runs differ by as much as the methods do). Prints decode tok/s (tokens over decode seconds, summed per method
and round), the ratio to mlx-lm and the mean acceptance length, and checks every output
equals mlx-lm's. Use it to measure a change to a draft (its vocabulary, quantization). --shared-policy adds
"adaptive shared": one adaptive policy per draft for all its generations (warm-up included), as
the server and the benchmark keep one, next to "adaptive", a fresh policy per generation.
--eager-blocks runs every setting a second time with ``target.COMPILE_BLOCKS`` off (verify
blocks eager, their projections unpacked) to measure what compiling them gives on this device.
On Linux CPUs run it with the OpenBLAS LD_PRELOAD that `mlx-dflash doctor` prints.
"""

import argparse
from collections import defaultdict

from mlx_dflash import generate, load_draft, load_target
from mlx_dflash import target as target_module
from mlx_dflash.bench import humaneval_prompts, run_mlx_lm
from mlx_dflash.data import encode_chat, read_prompts
from mlx_dflash.models import DEFAULT_MODEL
from mlx_dflash.policy import BlockPolicy
from mlx_dflash.target import float_dtype

parser = argparse.ArgumentParser()
parser.add_argument("drafts", nargs="+")
parser.add_argument("--model", default=DEFAULT_MODEL)
parser.add_argument("--num-prompts", type=int, default=4)
parser.add_argument("--tokens", type=int, default=256)
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--block-sizes", type=int, nargs="+", default=[16])
parser.add_argument("--shared-policy", action="store_true")
parser.add_argument("--eager-blocks", action="store_true")
parser.add_argument("--prompts", default=None, help="JSONL prompts (default: the bench's HumanEval set)")
args = parser.parse_args()

model, tok = load_target(args.model)
drafts = {name: load_draft(name, dtype=float_dtype(model)) for name in args.drafts}
texts = read_prompts(args.prompts) if args.prompts else humaneval_prompts()
prompts = [encode_chat(tok, p) for p in texts[: args.num_prompts]]
settings = {f"block {size}": dict(block_size=size) for size in args.block_sizes} | {"adaptive": dict(adaptive=True)}
EAGER = ", eager blocks"
labels = list(settings) + (["adaptive shared"] if args.shared_policy else [])
labels += [label + EAGER for label in labels] if args.eager_blocks else []
shared = {(name, label): BlockPolicy(draft.block_size) for name, draft in drafts.items() for label in labels}


def run(name: str, label: str, prompt: list[int], max_tokens: int):
    """One generation of ``name`` with the setting ``label``."""
    target_module.COMPILE_BLOCKS = False if label.endswith(EAGER) else None  # None: the device's default
    setting = label.removesuffix(EAGER)
    options = dict(adaptive=shared[name, label]) if setting == "adaptive shared" else settings[setting]
    return generate(model, tok, prompt, drafts[name], max_tokens=max_tokens, **options)


for name in drafts:  # warm-up: first uses of every shape
    for label in labels:
        run(name, label, prompts[0], 64)

for round_index in range(args.rounds):
    tokens, seconds, accepted = defaultdict(int), defaultdict(float), defaultdict(list)
    for prompt in prompts:
        reference, _, decode_s, _ = run_mlx_lm(model, tok, prompt, args.tokens)
        tokens["mlx-lm"] += len(reference) - 1  # as for DFlash: the prefill's token is not decoded
        seconds["mlx-lm"] += decode_s
        for name in drafts:
            for label in labels:
                method = f"{name} {label}"
                result = run(name, label, prompt, args.tokens)
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
