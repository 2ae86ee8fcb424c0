"""60 RoPE calls (SmolLM2-135M's q and k of 30 layers: 9 and 3 heads of 64, offset 300), one row and
16 rows: `nn.RoPE` (MLX's CPU fallback) against `cpu_kernels.rope`, its table made afresh each
time (once per forward, as in decoding); median ms of 15; and whether the outputs are bit-equal.
    PYTHONPATH=src python rope_calls.py"""
import time

import mlx.core as mx
import mlx.nn as nn

from mlx_dflash import cpu_kernels


def median_ms(f, reps: int = 15) -> float:
    times = []
    for _ in range(reps):
        cpu_kernels._rotations.cache_clear()
        tic = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - tic)
    return 1000 * sorted(times)[reps // 2]


module = nn.RoPE(64, base=100000.0)
for L in (1, 16):
    xs = [mx.random.normal((1, 9, L, 64)) for _ in range(30)] + [mx.random.normal((1, 3, L, 64)) for _ in range(30)]
    mx.eval(xs)
    equal = all(mx.array_equal(module(x, offset=300), cpu_kernels.rope(module, x, 300)).item() for x in xs)
    print(f"L={L:2d}: nn.RoPE x60 {median_ms(lambda: [module(x, offset=300) for x in xs]):.2f} ms, "
          f"cpu_kernels.rope x60 {median_ms(lambda: [cpu_kernels.rope(module, x, 300) for x in xs]):.2f} ms, "
          f"bit-equal: {equal}")
