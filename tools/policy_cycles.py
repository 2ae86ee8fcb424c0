"""Where an adaptive run's decode time went, size by size, from a benchmark's results.

    mlx-dflash bench ... --tree-budgets 64 --out RESULTS
    python tools/policy_cycles.py RESULTS/results.json

For every method whose policy kept its cycles (`bench` keeps the adaptive methods'
``policy_cycles``: each cycle's size, tokens committed, wall seconds), per size the policy ran
(plain steps, chains, trees of B nodes): its cycles, how many came right after a cycle of another
size (a switch: a probe's first cycle, or a return from one), the tokens they committed, their
share of the decode time, tokens a second, and the median wall time of a steady cycle (after one
of its own size) beside that of a switch. A size whose switches cost far more than its steady
cycles makes every probe of it dear; one that commits fewer tokens a second than the size the
policy mostly runs, yet takes a large share of the time, is chosen where it loses.
"""

import argparse
import statistics
import sys
from collections import defaultdict

from mlx_dflash import DFlashError
from mlx_dflash.bench import read_runs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a results.json that `mlx-dflash bench --out` wrote")
    return parser.parse_args()


def size_name(size: int, tree_budgets: list[int]) -> str:
    if size == 1:
        return "plain step"
    return f"tree of {size - 1}" if size - 1 in tree_budgets else f"chain of {size}"


def median_ms(seconds: list[float]) -> str:
    return f"{1000 * statistics.median(seconds):.2f}" if seconds else "-"


def report(method: str, runs: list[dict], tree_budgets: list[int]) -> None:
    cycles = defaultdict(int)
    tokens = defaultdict(int)
    timed_tokens = defaultdict(int)  # (tokens a second: over the timed cycles only)
    spent = defaultdict(float)
    steady, switch = defaultdict(list), defaultdict(list)
    for run in runs:
        previous = None
        for size, committed, seconds, _forecast in run["policy_cycles"]:
            cycles[size] += 1
            tokens[size] += committed
            if seconds is not None:  # (None: not timed, the consumer held most of its window)
                timed_tokens[size] += committed
                spent[size] += seconds
                (steady if size == previous else switch)[size].append(seconds)
            previous = size
    total_tokens, total_seconds = sum(tokens.values()), sum(spent.values())
    print(f"{method}: {len(runs)} {'text' if len(runs) == 1 else 'texts'}, {sum(cycles.values())} cycles, {total_tokens} tokens in "
          f"{total_seconds:.2f} s ({sum(timed_tokens.values()) / total_seconds:.1f} tok/s)")
    print("| size | cycles | after another size | tokens | tokens a cycle | share of the time | tok/s "
          "| steady cycle ms (median) | switch ms (median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in sorted(cycles):
        print(f"| {size_name(size, tree_budgets)} | {cycles[size]} | {len(switch[size])} | {tokens[size]} "
              f"| {tokens[size] / cycles[size]:.2f} | {spent[size] / total_seconds:.1%} "
              f"| {timed_tokens[size] / spent[size]:.1f} | {median_ms(steady[size])} | {median_ms(switch[size])} |")
    print()


def fail(message: str) -> int:
    print(f"policy_cycles: {message}", file=sys.stderr)
    return 2


def main() -> None:
    args = parse_args()
    try:
        results, runs = read_runs(args.results, "policy_cycles",
                                  "no run in this file kept its policy's cycles (bench keeps the adaptive methods')")
    except DFlashError as error:
        sys.exit(fail(str(error)))
    tree_budgets = list(results.get("config", {}).get("tree_budgets", []))
    by_method = defaultdict(list)
    for run in runs:
        by_method[run["method"]].append(run)
    for method, runs in by_method.items():
        report(method, runs, tree_budgets)


if __name__ == "__main__":
    main()
