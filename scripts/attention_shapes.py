"""Host time of block attention when the key length changes every call, against a fixed one.

    python scripts/attention_shapes.py [--calls 40]

A verify's 16 queries attend to a cache that grows by the accepted tokens each cycle, so
without cuDNN MLX runs them as matmuls whose shapes are new almost every cycle. This times,
per model pass (30 layers at SmolLM2-135M's heads), the host's ``mx.async_eval`` and the wall
time, for: keys growing by 4 a call (what a verify meets), keys padded to a fixed 1,024 with a
mask (a buffer read whole), and one query over growing keys (mlx-lm's plain step).
"""

import argparse
import time

import mlx.core as mx

parser = argparse.ArgumentParser()
parser.add_argument("--calls", type=int, default=40)
parser.add_argument("--layers", type=int, default=30)
args = parser.parse_args()

HEADS, KV_HEADS, HEAD_DIM, START = 9, 3, 64, 600
dtype = mx.bfloat16


def one_pass(queries: int, key_len: int, padded_to: int | None) -> tuple[float, float]:
    """(host ms in async_eval, wall ms) of one model pass worth of attention calls."""
    length = padded_to or key_len
    q = mx.random.normal((1, HEADS, queries, HEAD_DIM)).astype(dtype)
    k = mx.random.normal((1, KV_HEADS, length, HEAD_DIM)).astype(dtype)
    v = mx.random.normal((1, KV_HEADS, length, HEAD_DIM)).astype(dtype)
    mx.eval(q, k, v)
    if padded_to:
        mask = mx.arange(length)[None] <= (key_len - queries + mx.arange(queries))[:, None]
    else:
        mask = "causal" if queries > 1 else None
    tic = time.perf_counter()
    outs = [mx.fast.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5, mask=mask) for _ in range(args.layers)]
    built = time.perf_counter()
    mx.async_eval(outs)
    launched = time.perf_counter()
    mx.eval(outs)
    done = time.perf_counter()
    return 1000 * (launched - built), 1000 * (done - tic)


print(mx.default_device(), f"{args.layers} attention calls a pass, keys from {START}")
for name, queries, step, padded in [("16 queries, keys +4 a pass", 16, 4, None),
                                    ("16 queries, keys in a fixed 1,024 buffer + mask", 16, 4, 1024),
                                    ("1 query, keys +1 a pass (mlx-lm's plain step)", 1, 1, None),
                                    ("16 queries, keys +4 a pass (again)", 16, 4, None)]:
    launch, wall = zip(*(one_pass(queries, START + step * i, padded) for i in range(args.calls)))
    print(f"{name}: async_eval {sorted(launch)[len(launch) // 2]:.2f} ms, wall {sorted(wall)[len(wall) // 2]:.2f} ms (medians)",
          flush=True)
