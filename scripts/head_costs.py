"""What the output head costs, alone, in the forms MLX can run it: for one row (mlx-lm's step)
and for a block of rows (a verify), next to a plain read of the same weight (the floor a
bandwidth-bound head could reach).

Why: at Qwen3.5-9B's shape on the H200 the 248k-way head was ~7.5 ms of a 10.5 ms forward
(scripts/verify_part_shares.py, eleventh session), where reading its 2 GB should take ~0.5 ms.

    python scripts/head_costs.py [--vocab 248320] [--hidden 4096] [--rows 1 16] [--quant 4]
"""

import argparse

import mlx.core as mx
import mlx.nn as nn

from mlx_dflash.projections import rowwise_product
from mlx_dflash.scale import milliseconds_per_call

parser = argparse.ArgumentParser()
parser.add_argument("--vocab", type=int, default=248320)
parser.add_argument("--hidden", type=int, default=4096)
parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
parser.add_argument("--chunks", type=int, default=8, help="vocabulary pieces for the chunked form")
parser.add_argument("--quant", type=int, choices=[4, 8])
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--iters", type=int, default=20)
args = parser.parse_args()

dtype = getattr(mx, args.dtype)
head = nn.Linear(args.hidden, args.vocab, bias=False)
head.set_dtype(dtype)
if args.quant:
    nn.quantize(head, group_size=64, bits=args.quant)
mx.eval(head.parameters())
weight = head.weight
gigabytes = sum(p.nbytes for _, p in nn.utils.tree_flatten(head.parameters())) / 1e9
print(f"{mx.default_device()}, MLX {mx.__version__}, head {args.vocab} x {args.hidden} {args.dtype}"
      f"{f' {args.quant}-bit' if args.quant else ''}, {gigabytes:.2f} GB, ms per call")


def timed(name: str, build) -> None:
    ms = milliseconds_per_call(lambda: mx.eval(build()), args.iters)
    print(f"  {name:<44} {ms:8.3f} ms  ({gigabytes / ms:6.2f} TB/s of the head)")


timed("read the weight once (max over each row)", lambda: mx.max(weight, axis=1))
pieces = None
if not args.quant:
    transposed = mx.contiguous(weight.T)
    mx.eval(transposed)
    step = -(-args.vocab // args.chunks)
    pieces = [weight[i:i + step] for i in range(0, args.vocab, step)]
    mx.eval(pieces)
for rows in args.rows:
    x = mx.random.normal((1, rows, args.hidden)).astype(dtype)
    mx.eval(x)
    print(f" {rows} row(s)")
    timed("head(x) (mlx-lm's form)", lambda: head(x))
    timed("argmax(head(x))", lambda: mx.argmax(head(x), axis=-1))
    if args.quant:
        continue
    timed("x @ weight.T, weight transposed in memory", lambda: x @ transposed)
    timed("weight @ x[..., None] (row by row)", lambda: rowwise_product(x, weight))
    timed(f"{args.chunks} vocabulary pieces, concatenated",
          lambda: mx.concatenate([x @ piece.T for piece in pieces], axis=-1))
    compiled = mx.compile(lambda x: mx.argmax(head(x), axis=-1))
    timed("argmax(head(x)) compiled", lambda: compiled(x))
