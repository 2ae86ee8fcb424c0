"""Stalls in a benchmark's runs: responses that came far later than their text's usual pace.

    mlx-dflash bench ... --out RESULTS
    python tools/stalls.py RESULTS/results.json [--factor 2]

`bench` keeps each run's ``gaps``: the seconds from each response to the next (a step of
mlx-lm's, a cycle of ours). Per method: the gaps, their median, the stalls (gaps over
``--factor`` times the median of their own text's gaps), the seconds the stalls took beyond that
median, as a share of the method's decode time, how many came at a text's first response after
its first token, how far that first gap runs past its text's median (the median over texts), how
many came at a cycle that first reaches a longer key buffer (see ``first_reached_buffers``), and at
which response of their text they came.
A stall that every method meets alike (the machine busy elsewhere) costs no method its ratio; one
that a method meets far more often (kernels built mid-text for a shape it alone runs, a policy
reacting to a stall by switching sizes) is where that method loses time. (Where a cycle's cost
grows with its block, as on a CPU, the adaptive policy's larger blocks count as stalls too. On
GPUs the first block is queued behind the prefill, so a text's first cycle does not wait for its
graph to be built.)
"""

import argparse
import statistics
import sys
from collections import defaultdict

from mlx_dflash import DFlashError
from mlx_dflash.bench import read_runs
from mlx_dflash.rollback import padded


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a results.json that `mlx-dflash bench --out` wrote")
    parser.add_argument("--factor", type=float, default=2.0, help="a stall: a gap over this many times its text's median")
    args = parser.parse_args()
    if not args.factor > 1:
        sys.exit(fail(f"--factor must be above 1, got {args.factor}"))
    return args


def fail(message: str) -> int:
    print(f"stalls: {message}", file=sys.stderr)
    return 2


def first_reached_buffers(texts: list[dict], prompt_tokens: list[int], block_size: int) -> set[str]:
    """The cycles ("prompt:response") whose key reads, with the next block queued behind them (as on
    GPUs), first reach a buffer size no earlier cycle of the method reached: new shapes for a
    compiled verify. Runs in the order the benchmark ran them."""
    reached, found = 0, set()
    for run in texts:
        length = prompt_tokens[run["prompt"]]  # (the cache before the cycle: the prompt, then what was committed)
        for i, committed in enumerate(run["acceptance_lengths"]):
            reads = padded(length + 2 * block_size)  # (the engine's buffer size: mlx-lm's cache step)
            if reads > reached:
                reached = reads
                found.add(f"{run['prompt']}:{i + 1}")
            length += committed
    return found


def report(runs: list[dict], factor: float, prompt_tokens: list[int], block_size: int) -> None:
    print("| method | texts | gaps | median gap ms | stalls | stall ms beyond the median | share of the decode time "
          "| at a text's first response | first gap beyond its text's median (median of texts, ms) "
          "| at a key buffer first reached | where (response of its text) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    by_method = defaultdict(list)
    for run in runs:
        by_method[run["method"]].append(run)
    for method, texts in by_method.items():
        gaps, where, first_beyond, beyond, decode = [], [], [], 0.0, 0.0
        for run in texts:
            decode += run["decode_s"]
            usual = statistics.median(run["gaps"])
            first_beyond.append(run["gaps"][0] - usual)
            for i, gap in enumerate(run["gaps"]):
                if gap > factor * usual:
                    where.append(f"{run['prompt']}:{i + 1}")
                    beyond += gap - usual
            gaps += run["gaps"]
        at_first = sum(place.endswith(":1") for place in where)
        at_buffer = "-"
        if prompt_tokens and all(run.get("acceptance_lengths") for run in texts):
            at_buffer = len(first_reached_buffers(texts, prompt_tokens, block_size).intersection(where))
        shown = " ".join(where[:12]) + (f" (+{len(where) - 12})" if len(where) > 12 else "")
        print(f"| {method} | {len(texts)} | {len(gaps)} | {1000 * statistics.median(gaps):.2f} | {len(where)} "
              f"| {1000 * beyond:.1f} | {beyond / decode:.1%} | {at_first} | {1000 * statistics.median(first_beyond):.1f} "
              f"| {at_buffer} | {shown or '-'} |")


def main() -> None:
    args = parse_args()
    try:
        results, runs = read_runs(args.results, "gaps",
                                  "no run in this file kept the gaps between its responses (a results.json of an older bench?)")
    except DFlashError as error:
        sys.exit(fail(str(error)))
    # (prompt lengths: not in the results of an older bench, whose key-buffer column stays "-")
    report(runs, args.factor, results.get("prompt_tokens", []), results.get("block_size", 16))


if __name__ == "__main__":
    main()
