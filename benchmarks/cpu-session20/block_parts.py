"""Where a block's non-GEMM time goes on this CPU: SmolLM2-135M's shapes (9 query heads over 3
key heads of 64, 300 keys, 1,536-wide MLP), 30 layers' worth of each part, median ms of 15, for
M = 1, 8, 16 rows; MLX's own ops against cpu_kernels'. Then the GEMMs alone (30 layers of
distinct weights, so they stream from memory as in a forward, and the 49,152-way head).
    OPENBLAS_CORETYPE=SkylakeX LD_PRELOAD=.../openblas-pthread/libblas.so.3 PYTHONPATH=src python block_parts.py"""
import time

import mlx.core as mx
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from mlx_dflash import cpu_kernels


def median_ms(f, reps: int = 15) -> float:
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - tic)
    return 1000 * sorted(times)[reps // 2]


def parts(M: int) -> str:
    q = [mx.random.normal((1, 9, M, 64)) for _ in range(30)]
    k = [mx.random.normal((1, 3, 300 + M, 64)) for _ in range(30)]
    v = [mx.random.normal((1, 3, 300 + M, 64)) for _ in range(30)]
    gate = [mx.random.normal((1, M, 1536)) for _ in range(30)]
    up = [mx.random.normal((1, M, 1536)) for _ in range(30)]
    mx.eval(q, k, v, gate, up)
    mask = "causal" if M > 1 else None
    costs = {
        "mx.fast.sdpa": median_ms(lambda: [mx.fast.scaled_dot_product_attention(*t, scale=0.125, mask=mask)
                                           for t in zip(q, k, v)]),
        "cpu_kernels.attention": median_ms(lambda: [cpu_kernels.attention(*t, 0.125, mask) for t in zip(q, k, v)]),
        "mlx-lm swiglu": median_ms(lambda: [mlx_lm_swiglu(g, u) for g, u in zip(gate, up)]),
        "cpu_kernels.swiglu": median_ms(lambda: [cpu_kernels.swiglu(g, u) for g, u in zip(gate, up)]),
        "mx.exp (M x 1536)": median_ms(lambda: [mx.exp(g) for g in gate]),
        "cpu_kernels.exp": median_ms(lambda: [cpu_kernels.exp(g) for g in gate]),
    }
    return f"M={M:2d}: " + ", ".join(f"{name} {ms:.1f}" for name, ms in costs.items())


def gemms(M: int) -> str:
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
    weights = [[mx.random.normal(s) * 0.02 for s in shapes] for _ in range(30)]
    head = mx.random.normal((49152, 576)) * 0.02
    x, wide = mx.random.normal((M, 576)), mx.random.normal((M, 1536))
    mx.eval(weights, head, x, wide)
    body = median_ms(lambda: [(x if w.shape[1] == 576 else wide) @ w.T for layer in weights for w in layer], 9)
    return f"M={M:2d}: 30 layers' GEMMs {body:.1f} ms, head {median_ms(lambda: x @ head.T, 9):.1f} ms"


print("ms for 30 layers (sdpa, swiglu, exp of an M x 1536 array):")
for M in (1, 8, 16):
    print(parts(M), flush=True)
for M in (1, 8, 16):
    print(gemms(M), flush=True)
