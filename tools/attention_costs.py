"""Our one-launch block attention (``cuda_attention``) against MLX's own call, shape by shape.

    python tools/attention_costs.py [--heads 9 --kv-heads 3 --head-dim 64] [--batch 1 8]
        [--queries 16 64] [--keys 256 512 1024 2048 4096] [--mask causal array]

For each batch x queries x keys (a verify's block or tree, a draft pass's block) and mask
("causal": a chain's block; "array": a boolean [queries, keys] mask, as trees pass), the time
per call of each, ``--layers`` calls queued back to back and read once (as a forward's layers
run: the host's launches count), median of ``--iters``, and whether the two outputs agree (to
the dtype's rounding). ``cuda_attention.fits`` decides which one the engine takes: the last
column says what it picks today. Needs MLX's CUDA backend.
"""

import argparse
import statistics
import sys
import time

import mlx.core as mx

from mlx_dflash import cuda_attention
from mlx_dflash.device import on_cuda

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--heads", type=int, default=9, help="query heads (default: SmolLM2-135M's)")
parser.add_argument("--kv-heads", type=int, default=3)
parser.add_argument("--head-dim", type=int, default=64)
parser.add_argument("--batch", type=int, nargs="+", default=[1])
parser.add_argument("--queries", type=int, nargs="+", default=[16, 64])
parser.add_argument("--keys", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
parser.add_argument("--mask", choices=["causal", "array"], nargs="+", default=["causal", "array"])
parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
parser.add_argument("--layers", type=int, default=30)
parser.add_argument("--iters", type=int, default=20)
args = parser.parse_args()
if not on_cuda():
    sys.exit("attention_costs: our block attention runs on MLX's CUDA backend only")


def ms_per_call(attend, queries, keys, values, mask) -> float:
    """Median over ``--iters`` of ``--layers`` queued calls, per call."""
    times = []
    for _ in range(args.iters + 2):
        start = time.perf_counter()
        mx.eval([attend(queries, keys, values, mask) for _ in range(args.layers)])
        times.append((time.perf_counter() - start) * 1e3 / args.layers)
    return statistics.median(times[2:])  # (the first two build kernels)


def ours(queries, keys, values, mask):
    return cuda_attention.block_attention(queries, keys, values, scale, mask)


def mlx_call(queries, keys, values, mask):
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


dtype = getattr(mx, args.dtype)
TOLERANCE = 1e-4 if args.dtype == "float32" else 2e-2  # (half precision: outputs rounded to ~3 digits)
scale = args.head_dim ** -0.5
print(f"MLX {mx.__version__} {mx.default_device()}, {args.heads} query heads, {args.kv_heads} key heads, "
      f"head size {args.head_dim}, {args.dtype}, {args.layers} calls queued")
print("| mask | batch | queries | keys | heads x keys | ours ms | MLX ms | ours/MLX | same output | fits today |")
print("|---|---|---|---|---|---|---|---|---|---|")
for kind in args.mask:
    for batch in args.batch:
        for length in args.queries:
            for size in args.keys:
                # queries as a forward passes them: a transposed view of [batch, queries, heads, dim]
                queries = mx.random.normal((batch, length, args.heads, args.head_dim)).astype(dtype).transpose(0, 2, 1, 3)
                keys, values = (mx.random.normal((batch, args.kv_heads, size, args.head_dim)).astype(dtype)
                                for _ in range(2))
                mask = "causal" if kind == "causal" else mx.tril(mx.ones((length, size), mx.bool_), k=size - length)
                mx.eval(queries, keys, values, *([mask] if kind == "array" else []))
                mine, theirs = (ms_per_call(f, queries, keys, values, mask) for f in (ours, mlx_call))
                same = mx.allclose(ours(queries, keys, values, mask), mlx_call(queries, keys, values, mask),
                                   rtol=TOLERANCE, atol=TOLERANCE).item()
                picks = "ours" if cuda_attention.fits(queries, keys, values, mask) else "MLX"
                print(f"| {kind} | {batch} | {length} | {size} | {args.heads * size} | {mine:.4f} | {theirs:.4f} "
                      f"| {mine / theirs:.2f} | {same} | {picks} |", flush=True)
