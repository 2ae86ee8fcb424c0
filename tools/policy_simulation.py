"""The adaptive policy on a simulated pair: how many cycles it runs plain, as blocks, with forecasts.

    python tools/policy_simulation.py [--cycles 500] [--block-cost 2.7] [--switch-cost 1.0]
        [--forecast-cost 0.6] [--slot-decay 0.98] [--runs RESULTS_JSON ...]

Each cycle the draft's true acceptance run is drawn at random (slot 1 accepted with probability
P1, each later slot with PK, as long as the ones before were), or, with ``--runs``, taken in turn
from the fixed-block DFlash runs of `mlx-dflash bench` results (their acceptance lengths: real
texts, where a hit at slot 1 makes hits further on likelier; one policy serves a file's texts in
turn after a warm-up that times every size, as in `bench` and the server); a plain step costs 1 (right
after a block ``--switch-cost``: on a GPU that step takes the masked attention path; in a text's
first cycles ``--early-plain-cost``), a block
``--block-cost`` (an H200 with SmolLM2-135M: a verified block ~2.7 plain steps whatever its size;
a 2-core CPU: 1.43 1.8 2.27 3.13 for 2, 4, 8, 16), a forecast ``--forecast-cost``
more. Prints the cycles of each kind and the tokens per unit of cost (plain decoding: 1.0). If
the policy picks blocks here where plain decoding wins, its rule is wrong; if it does not here
but does in a real generation, what it measures there is.
"""

import argparse
import itertools
import json
import random
from typing import Iterator

from mlx_dflash.policy import SLOT_DECAY, BlockPolicy, candidate_sizes

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cycles", type=int, default=500)
parser.add_argument("--block-cost", type=float, nargs="+", default=[2.7],
                    help="a block's cost in plain steps: one for every size, or one each for 2, 4, 8, 16")
parser.add_argument("--switch-cost", type=float, default=1.0, help="a plain step's cost right after a block")
parser.add_argument("--early-plain-cost", type=float, default=1.0,
                    help="a plain step's cost in a text's first --early-cycles cycles")
parser.add_argument("--early-cycles", type=int, default=12)
parser.add_argument("--forecast-cost", type=float, default=0.6, help="a forecast's draft pass, in plain steps")
parser.add_argument("--slot-decay", type=float, default=SLOT_DECAY, help="how fast acceptance statistics fade")
parser.add_argument("--runs", nargs="*", default=[], help="bench results.json files: replay their acceptance")
args = parser.parse_args()
BLOCK_COST = dict(zip([2, 4, 8, 16], args.block_cost * 4 if len(args.block_cost) == 1 else args.block_cost))


def random_runs(p1: float, pk: float, seed: int) -> Iterator[int]:
    rnd = random.Random(seed)
    while True:
        run, p = 0, p1  # drafted tokens the target would accept
        while run < 15 and rnd.random() < p:
            run, p = run + 1, pk
        yield run


def simulate(runs: Iterator[int], policy: BlockPolicy) -> tuple[int, int, int, float]:
    policy.start_text()
    plain = blocks = forecasts = tokens = 0
    spent, previous = 0.0, 16
    for cycle, run in zip(range(args.cycles), runs):
        block = policy.choose()
        forecast = policy.wants_forecast
        plain += block == 1
        blocks += block > 1
        forecasts += forecast
        steady_plain = args.early_plain_cost if cycle < args.early_cycles else 1.0
        cost = (args.switch_cost if previous > 1 else steady_plain) if block == 1 else BLOCK_COST[block]
        cost += args.forecast_cost * forecast
        acceptance = min(run, block - 1) + 1
        spent, tokens, previous = spent + cost, tokens + acceptance, block
        # the draft's guesses past the verified tokens, as the engine hands them over: a forecast's
        # (its first `run` come true), or one past a short block wholly accepted; token 0 comes true
        guess = None
        if forecast:
            guess = [0] * run + [1] * (policy.max_block - 1 - run)
        elif 1 < block < policy.max_block and acceptance == block:
            guess = [0 if run >= block else 1]
        policy.record_cycle(block, [0] * acceptance, cost, guess)
    return plain, blocks, forecasts, tokens / spent


def new_policy() -> BlockPolicy:
    return BlockPolicy(16, tree_budgets=(), slot_decay=args.slot_decay)


def warmed_up_policy() -> BlockPolicy:
    """A policy that has timed every size (a server's or `bench`'s warm-up)."""
    policy = new_policy()
    for block in candidate_sizes(policy.max_block):
        for _ in range(3):
            policy.record(block, 1, BLOCK_COST.get(block, 1.0))
    return policy


def report(name: str, counts: tuple[int, int, int, float]) -> None:
    plain, blocks, forecasts, rate = counts
    print(f"{name}: {plain} plain ({forecasts} with a forecast), {blocks} blocks, {rate:.3f} tokens per plain "
          f"step's cost", flush=True)


for p1, pk in [(0.3, 0.2), (0.3, 0.5), (0.1, 0.1), (0.0, 0.0), (0.9, 0.9)]:
    for seed in (0, 1):
        report(f"P1 {p1}, PK {pk}, seed {seed}", simulate(random_runs(p1, pk, seed), new_policy()))
for path in args.runs:
    shared = warmed_up_policy()
    for run in json.load(open(path))["runs"]:
        if run["method"] == "dflash":  # fixed 16-token blocks: each cycle's run of accepted drafts
            lengths = run["acceptance_lengths"][:-1]  # (the last block may be cut by the length)
            mean = sum(lengths) / len(lengths)
            report(f"{path} prompt {run['prompt']} (mean acceptance {mean:.2f})",
                   simulate(itertools.cycle(a - 1 for a in lengths), shared))
