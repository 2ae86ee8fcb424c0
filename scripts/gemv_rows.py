"""A block's projections as one batched matrix-vector product: cheaper to launch, and each row
computed as a one-token step computes it?

    PYTHONPATH=src python scripts/gemv_rows.py [--rows 16] [--layers 30] [--iters 20]

On MLX's CUDA backend a matmul of one row (mlx-lm's step) runs MLX's own gemv kernel, one graph
node; one of 16 rows runs cuBLAS, captured into a child graph per call. ``mx.matmul(W, x[..., None])``
asks for the same products as ``x @ W.T`` but as a batch of matrix-vector products (N = 1, the
weight broadcast over the batch), which MLX also sends to its gemv kernel, with the same
per-row arithmetic as the one-row step. This times both forms through a SmolLM2-135M-shaped stack
of projections (q, k, v, o, gate, up, down per layer; bf16), host launch (``mx.async_eval``) and the
wait after it, eager and compiled, and checks the rows bit for bit against one-row products.
"""

import argparse
import statistics
import time

import mlx.core as mx

from mlx_dflash.projections import rowwise_product as rows

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=16)
parser.add_argument("--layers", type=int, default=30)
parser.add_argument("--hidden", type=int, default=576)
parser.add_argument("--intermediate", type=int, default=1536)
parser.add_argument("--kv", type=int, default=192)
parser.add_argument("--iters", type=int, default=20)
parser.add_argument("--dtype", default="bfloat16")
args = parser.parse_args()
dtype = getattr(mx, args.dtype)
h, f = args.hidden, args.intermediate
shapes = [(h, h), (args.kv, h), (args.kv, h), (h, h), (f, h), (f, h), (h, f)]  # (out, in) as nn.Linear
weights = [[(mx.random.normal(s) / s[1] ** 0.5).astype(dtype) for s in shapes] for _ in range(args.layers)]
mx.eval(weights)


def plain(x, w):
    return x @ w.T


def stack(project):
    def forward(x):
        for q, k, v, o, gate, up, down in weights:
            a = project(x, q) + mx.concatenate([project(x, k), project(x, v)], axis=-1)[..., :h].sum() * 0
            x = x + project(a, o)
            x = x + project(project(x, gate) * mx.sigmoid(project(x, up)), down)
        return x
    return forward


def measure(name, fn, x):
    launch, wait = [], []
    for i in range(args.iters + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        out = fn(x)
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        if i >= 3:
            launch.append(t1 - t0), wait.append(t2 - t1)
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    print(f"{name:28s} build+launch {ms(launch):6.2f} ms | wait {ms(wait):6.2f} ms", flush=True)
    return out


print(f"MLX {mx.__version__}, {mx.default_device()}, {args.rows} rows, {args.layers} layers, {args.dtype}", flush=True)
x = mx.random.normal((args.rows, h)).astype(dtype)
for w in (weights[0][0], weights[0][4], weights[0][6]):
    xi = mx.random.normal((args.rows, w.shape[1])).astype(dtype)
    one_row = mx.concatenate([plain(xi[i:i + 1], w) for i in range(args.rows)])
    print(f"W {tuple(w.shape)}: rows form equals one-row products bit for bit: "
          f"{mx.array_equal(rows(xi, w), one_row).item()}; plain {args.rows}-row form does: "
          f"{mx.array_equal(plain(xi, w), one_row).item()} (max diff "
          f"{mx.abs(plain(xi, w).astype(mx.float32) - one_row.astype(mx.float32)).max().item():.3g})", flush=True)
outs = {}
for name, fn in [("plain", stack(plain)), ("rows", stack(rows))]:
    outs[name] = measure(f"{name} eager", fn, x)
    measure(f"{name} compiled", mx.compile(fn), x)
measure("plain eager, 1 row", stack(plain), x[:1])
print(f"stack outputs: rows vs plain max diff "
      f"{mx.abs(outs['rows'].astype(mx.float32) - outs['plain'].astype(mx.float32)).max().item():.3g}")
