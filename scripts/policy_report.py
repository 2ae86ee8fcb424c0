"""What each adaptive run's policy chose and what it measured, from `mlx-dflash bench` results.

    python scripts/policy_report.py RESULTS_JSON [RESULTS_JSON ...]

Per adaptive run: its speed-up over the baseline on that prompt, the sizes it ran cycle by cycle
(``.`` a plain step, ``f`` a plain step with a forecast, a hex digit the block size, ``10`` = 16),
and the median seconds of each size's steady cycles (those after a cycle of the same size: what
the policy times). Use it to see why a policy stayed on blocks or on plain steps.
"""

import json
import statistics
import sys


def sizes_string(cycles: list) -> str:
    return "".join("f" if forecast else "." if block == 1 else format(block, "x") for block, _, _, forecast in cycles)


for path in sys.argv[1:]:
    runs = json.load(open(path))["runs"]
    baseline = {(r["prompt"], r["length"]): r["decode_s"] / max(len(r["tokens"]) - 1, 1)
                for r in runs if r["method"] == "baseline"}
    for run in runs:
        cycles = run.get("policy_cycles") or []
        if not cycles:
            continue
        per_token = run["decode_s"] / max(len(run["tokens"]) - 1, 1)
        steady: dict[int, list[float]] = {}
        for (block, _, seconds, forecast), previous in zip(cycles[1:], cycles):
            if block == previous[0] and not forecast:
                steady.setdefault(block, []).append(seconds)
        costs = ", ".join(f"{block}: {1000 * statistics.median(s):.1f} ms ({len(s)})" for block, s in sorted(steady.items()))
        print(f"{path} {run['method']} prompt {run['prompt']} length {run['length']}: "
              f"{baseline[(run['prompt'], run['length'])] / per_token:.2f}x, {len(cycles)} cycles")
        print(f"  sizes: {sizes_string(cycles)}")
        print(f"  steady cycles, median: {costs}")
