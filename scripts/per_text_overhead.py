"""A fixed cost per text in DFlash's decode time? Least squares of decode seconds = F + c x cycles
over the fixed-block DFlash runs of `mlx-dflash bench` results (their prompts differ in cycles).

    python scripts/per_text_overhead.py RESULTS_JSON [RESULTS_JSON ...]

Prints F and c per file (where its runs have at least two distinct cycle counts) and over all
files together, with each run's (cycles, ms). Texts that end early (EOS) have few cycles, so a
cost paid once per text (new shapes on a GPU, a cycle launched past the end) weighs on their rate
as much as many cycles do. A fit over few prompts is rough: read F's spread across files.
"""

import argparse
import json

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("results", nargs="+")
parser.add_argument("--method", default="dflash", help="which runs (default: fixed blocks)")
args = parser.parse_args()


def fit(runs: list[tuple[int, float]]) -> tuple[float, float]:
    cycles = np.array([c for c, _ in runs], float)
    seconds = np.array([s for _, s in runs], float)
    (fixed, per_cycle), *_ = np.linalg.lstsq(np.vstack([np.ones_like(cycles), cycles]).T, seconds, rcond=None)
    return 1000 * fixed, 1000 * per_cycle


every = []
for path in args.results:
    runs = [(len(r["acceptance_lengths"]), r["decode_s"]) for r in json.load(open(path))["runs"]
            if r["method"] == args.method and r["acceptance_lengths"]]
    every += runs
    if len({c for c, _ in runs}) > 1:
        fixed, per_cycle = fit(runs)
        print(f"{path}: {fixed:.1f} ms + {per_cycle:.2f} ms x cycles "
              f"{[(c, round(1000 * s)) for c, s in runs]}")
if len({c for c, _ in every}) > 1:
    fixed, per_cycle = fit(every)
    print(f"all {len(every)} runs: {fixed:.1f} ms + {per_cycle:.2f} ms x cycles")
