"""Trees built on the device against trees built on the host (``EngineOptions.device_trees``),
with the chain beside them: decode speed, tokens per verify and ms per cycle, per prompt in turn.

    python tools/tree_costs.py [--model M] [--draft D] [--budgets 32 64] [--num-prompts 16] [--max-tokens 256]
                               [--tree-rowwise on off]

HumanEval chat prompts, greedy, fixed full blocks (every full block a tree of the budget);
each way runs every prompt once after a warm-up of its own, the ways alternating per prompt.
Both ways of a budget verify the same trees (where the host's stays within the device's
candidate prefixes: ``tree.device_tree``) and commit the target's own tokens (float32: the same
texts); what differs is whether the host reads the draft's candidates and the walk before the
next cycle is queued. ``--tree-rowwise on off`` instead runs the device's way twice, its
compiled verify's projections row by row and as one matmul (``EngineOptions.rowwise_products``).
"""

import argparse

from mlx_dflash import generate, load, use_fast_blas
from mlx_dflash.bench import humaneval_prompts, side_by_side_cells
from mlx_dflash.options import EngineOptions

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
parser.add_argument("--draft", default=None, help="default: the draft shipped for the model")
parser.add_argument("--budgets", type=int, nargs="+", default=[32, 64])
parser.add_argument("--num-prompts", type=int, default=16)
parser.add_argument("--max-tokens", type=int, default=256)
parser.add_argument("--tree-rowwise", choices=["on", "off"], nargs="+", default=None,
                    help="the device's way with its verify's projections row by row and/or not, instead of the host's way")
args = parser.parse_args()

use_fast_blas()
model, tokenizer, draft = load(args.model, args.draft)
prompts = humaneval_prompts()[: args.num_prompts]
ways = {"chain": (False, EngineOptions())}
for budget in args.budgets:
    # (the device's way forces the GPU's cycle: queued ahead, compiled, so the CPU runs it too)
    device = dict(queue_ahead=True, compile_blocks=True, device_trees=True)
    if args.tree_rowwise:
        for rowwise in args.tree_rowwise:
            ways[f"tree {budget}, device, row by row {rowwise}"] = (budget, EngineOptions(**device, rowwise_products=rowwise == "on"))
    else:
        ways[f"tree {budget}, device"] = (budget, EngineOptions(**device))
        ways[f"tree {budget}, host"] = (budget, EngineOptions(device_trees=False))
for trees, options in ways.values():
    generate(model, tokenizer, prompts[0], draft, max_tokens=32, chat=True, trees=trees, options=options, warmup=True)
results = {way: [] for way in ways}
for prompt in prompts:
    for way, (trees, options) in ways.items():
        results[way].append(generate(model, tokenizer, prompt, draft, max_tokens=args.max_tokens, chat=True,
                                     trees=trees, options=options))
chain = results["chain"]
print("| way | decode tok/s | median speed-up over the chain | tokens per verify | ms a cycle |\n|---|---|---|---|---|")
for way, runs in results.items():
    print(f"| {way} | {side_by_side_cells(runs, chain)} |")
for budget in [] if args.tree_rowwise else args.budgets:
    same = all(a.tokens == b.tokens for a, b in zip(results[f"tree {budget}, device"], results[f"tree {budget}, host"]))
    print(f"(tree {budget}: both ways gave the same tokens: {same})")
