"""A block's attention through ``cuda_attention`` against MLX's own call, by key length (MLX CUDA).

    python scripts/attention_kernel_costs.py [--keys 256 1024 4096 16384] [--block 16] [--iters 20] [--warps 16]

For each head layout (SmolLM2-135M float32, Qwen3-8B and Qwen3.5-9B's attention layers in bf16),
one call per layer of that model, each with its own queries, keys and values, compiled as a verify runs them: the
whole key buffer under a verify's mask (stale keys past each query). Milliseconds per pass of all
layers (evaluated each time: the device's time and the host's launches), and the largest
difference between the two outputs. The kernel walks every key once per (query, head) with one
warp reduction per key, where MLX's fallback runs cuBLAS matmuls: its launches are fewer, its
work per key larger, so long contexts are where it could lose.
"""

import argparse

import mlx.core as mx

from mlx_dflash import cuda_attention
from mlx_dflash.device import on_cuda
from mlx_dflash.rollback import visible_keys
from mlx_dflash.scale import milliseconds_per_call

# name: (query heads, key heads, head dim, layers, dtype)
LAYOUTS = {"smollm2-135m": (9, 3, 64, 30, mx.float32), "qwen3-8b": (32, 8, 128, 36, mx.bfloat16),
           "qwen3.5-9b": (16, 4, 256, 8, mx.bfloat16)}

parser = argparse.ArgumentParser()
parser.add_argument("--keys", type=int, nargs="+", default=[256, 1024, 4096, 16384])
parser.add_argument("--block", type=int, default=16)
parser.add_argument("--iters", type=int, default=20)
parser.add_argument("--warps", type=int, default=cuda_attention.WARPS, help="the kernel's warps per (query, head)")
args = parser.parse_args()
cuda_attention.WARPS = args.warps
if not on_cuda():
    raise SystemExit("the kernel runs on MLX's CUDA backend only")
print(f"{mx.default_device()}, MLX {mx.__version__}, block of {args.block} queries, {args.warps} warps", flush=True)


def per_layer(fn):
    return mx.compile(lambda qs, ks, vs, mask: [fn(q, k, v, q.shape[-1] ** -0.5, mask) for q, k, v in zip(qs, ks, vs)])


def random_layers(layers: int, shape: tuple, dtype: mx.Dtype) -> list[mx.array]:
    return [mx.random.normal(shape).astype(dtype) for _ in range(layers)]


def mlx_own(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


kernel, fallback = per_layer(cuda_attention.block_attention), per_layer(mlx_own)
for name, (heads, kv_heads, dim, layers, dtype) in LAYOUTS.items():
    for keys in args.keys:
        qs, ks, vs = (random_layers(layers, (1, n, length, dim), dtype)
                      for n, length in ((heads, args.block), (kv_heads, keys), (kv_heads, keys)))
        mask = visible_keys(keys, mx.array(keys - args.block - 40), args.block)  # (40 stale positions)
        mx.eval(qs, ks, vs, mask)
        ours, theirs = kernel(qs, ks, vs, mask), fallback(qs, ks, vs, mask)
        gap = max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() for a, b in zip(ours, theirs))
        times = [milliseconds_per_call(lambda f=f: mx.eval(f(qs, ks, vs, mask)), args.iters) for f in (kernel, fallback)]
        print(f"{name:13s} {keys:6d} keys x {layers} layers: kernel {times[0]:7.3f} ms, MLX's {times[1]:7.3f} ms "
              f"({times[1] / times[0]:.2f}x), largest difference {gap:.2e}", flush=True)
