"""Tried, not kept: exp as two fused kernels around the bits' view (Estrin polynomial), against
cpu_kernels.exp and mx.exp; median ms of 31. PYTHONPATH=src python exp_two_kernels.py"""
import time, mlx.core as mx, numpy as np
from functools import partial
from mlx_dflash import cpu_kernels as k
LOG2E = 1.4426950408889634
C = k.EXP2_POLYNOMIAL
LOWEST, HIGHEST = -87.0, 88.0

@partial(mx.compile, shapeless=True)
def bits_c(x):
    n = (mx.minimum(x, HIGHEST) * LOG2E + 12582912.0) - 12582912.0
    return (n.astype(mx.int32) + 127) * (1 << 23)

@partial(mx.compile, shapeless=True)
def combine_c(x, two_to_n):
    t = mx.minimum(x, HIGHEST) * LOG2E
    f = t - ((t + 12582912.0) - 12582912.0)
    c0, c1, c2, c3, c4, c5, c6 = C
    f2 = f * f
    p = ((c6 + c5 * f) + f2 * (c4 + c3 * f)) + (f2 * f2) * ((c2 + c1 * f) + c0 * f2)
    return mx.where(x < LOWEST, 0.0, p * two_to_n)

def exp_c(x):
    return combine_c(x, bits_c(x).view(mx.float32))

def med(f, reps=31):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); mx.eval(f()); ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2] * 1e3

x = mx.concatenate([mx.linspace(-87, 88, 200_001), mx.random.normal((10_000,)) * 5])
ours, theirs = np.array(exp_c(x)), np.array(mx.exp(x))
print("max rel err c:", (np.abs(ours - theirs) / theirs).max(), "ends", np.array(exp_c(mx.array([-np.inf, -100., -88.5, 0.0, 88.0, 88.5, 100.0]))))
for n in (24576, 45504, 245760):
    y = mx.random.normal((n,)) * 4 - 4; mx.eval(y)
    for name, fn in (("mx.exp", mx.exp), ("kernels.exp", k.exp), ("exp_c", exp_c)):
        print(f"n={n} {name}: {med(lambda: fn(y)):.3f} ms")
