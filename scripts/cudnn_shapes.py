"""What cuDNN attention costs when every verify has a new context length (MLX CUDA).

    MLX_CUDA_USE_CUDNN_SDPA=1 python scripts/cudnn_shapes.py

MLX caches one cuDNN graph per exact query/key shape, except for single-token queries over a
KV-cache buffer (one graph per 256-token buffer size, with a padding mask). A verify block's
key length grows every cycle, so (1) times block attention at 12 new lengths in a row (a graph
build each), (2) the same lengths with the keys padded to the 256-multiple buffer and an
additive mask hiding the padding (one graph per buffer size), against (3) the cached shape.
"""

import os
import time

import mlx.core as mx

import mlx_dflash  # noqa: F401

heads, kv_heads, head_dim, block, layers = 9, 3, 64, 16, 30
dtype = mx.bfloat16
print(f"{mx.default_device()}, MLX {mx.__version__}, "
      f"MLX_CUDA_USE_CUDNN_SDPA={os.environ.get('MLX_CUDA_USE_CUDNN_SDPA')}")
buffer = 1280
q = mx.random.normal((1, heads, block, head_dim)).astype(dtype)
k = mx.random.normal((1, kv_heads, buffer, head_dim)).astype(dtype)
v = mx.random.normal((1, kv_heads, buffer, head_dim)).astype(dtype)
mx.eval(q, k, v)
scale = head_dim**-0.5


def exact(length):
    return mx.fast.scaled_dot_product_attention(q, k[:, :, :length], v[:, :, :length], scale=scale, mask="causal")


def padded(length):
    rows = mx.arange(block)[:, None] + length - block
    visible = mx.arange(buffer)[None, :] <= rows
    bias = mx.where(visible, 0.0, -1e9).astype(dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=bias)


def ms(fn, length, repeat=1):
    mx.eval(fn(length))
    tic = time.perf_counter()
    for _ in range(repeat):
        mx.eval([fn(length) for _ in range(layers)])
    return (time.perf_counter() - tic) * 1000 / repeat


for name, fn in (("exact length", exact), ("padded + mask", padded)):
    firsts = []
    for length in range(1040, 1052):
        tic = time.perf_counter()
        mx.eval(fn(length))
        firsts.append((time.perf_counter() - tic) * 1000)
    print(f"{name}: first call at 12 new lengths {min(firsts):.2f}-{max(firsts):.2f} ms; "
          f"x{layers} calls at a seen length {ms(fn, 1045, 10):.2f} ms")
error = mx.abs(exact(1045).astype(mx.float32) - padded(1045).astype(mx.float32)).max().item()
print(f"max difference exact vs padded: {error:.2e}")
