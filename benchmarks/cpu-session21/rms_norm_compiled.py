"""Tried, not kept: RMSNorm as a reduction and one compiled function, bit-equal to nn.RMSNorm;
61 calls at 1 and 16 rows, median ms of 21. PYTHONPATH=src python rms_norm_compiled.py"""
import time, mlx.core as mx, mlx.nn as nn
from functools import partial
def med(f, reps=21):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); mx.eval(f()); ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2] * 1e3

@partial(mx.compile, shapeless=True)
def _scaled(x, mean_square, weight, eps):
    return (x * mx.rsqrt(mean_square + eps)) * weight

def rms_norm(module, x):
    return _scaled(x, mx.mean(mx.square(x), axis=-1, keepdims=True), module.weight, mx.array(module.eps, mx.float32))

norm = nn.RMSNorm(576, eps=1e-5); norm.weight = mx.random.normal((576,)); mx.eval(norm.parameters())
for M in (1, 16):
    xs = [mx.random.normal((1, M, 576)) * 3 for _ in range(61)]; mx.eval(xs)
    eq = all(mx.array_equal(norm(x), rms_norm(norm, x)).item() for x in xs[:5])
    a = med(lambda: [norm(x) for x in xs]); b = med(lambda: [rms_norm(norm, x) for x in xs])
    print(f"M={M}: nn.RMSNorm x61 {a:.2f} ms, compiled {b:.2f} ms, bit-equal {eq}")
