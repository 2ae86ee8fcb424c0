"""What the reductions of a tensor-parallel target cost, per collective and per forward.

    mlx.launch -n 2 --backend ring --hosts 127.0.0.1 -- python tools/shard_costs.py --hidden 1536 --layers 28
    mlx.launch -n 2 --backend nccl -- python tools/shard_costs.py --hidden 4096 --layers 36 --dtype bfloat16

A tensor-parallel forward (mlx-lm's ``shard()``) sums each attention and each MLP output over
the processes: two all-reduces of [rows, hidden] a layer. This times ``all_sum`` of that shape
(one plain step: 1 row; a verified block: 16 rows) back to back, median of ``--iters``, and
multiplies by 2 x ``--layers``: the communication a forward waits for, to set against a cycle's
time (``mlx-dflash bench`` under the same launch). Process 0 prints one JSON line per row count.
"""

import argparse
import json
import statistics
import time

import mlx.core as mx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    group = mx.distributed.init()
    for rows in args.rows:
        x = mx.random.normal((rows, args.hidden)).astype(getattr(mx, args.dtype))
        mx.eval(x)
        seconds = []
        for _ in range(args.iters + 5):
            tic = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=group))
            seconds.append(time.perf_counter() - tic)
        per_call = statistics.median(seconds[5:]) * 1000
        if group.rank() == 0:
            print(json.dumps({"processes": group.size(), "rows": rows, "hidden": args.hidden, "dtype": args.dtype,
                              "all_sum_ms": round(per_call, 4), "per_forward_ms": round(2 * args.layers * per_call, 3)}))


if __name__ == "__main__":
    main()
