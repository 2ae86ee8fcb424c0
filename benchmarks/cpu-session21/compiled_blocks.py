"""A 4- and 8-token verify through Target at 300 positions: compiled (the CPU default up to
CPU_COMPILED_BLOCK = 8 tokens; RoPE inside the trace is the module's) against eager (cpu_kernels with
RoPE tables), alternating, median ms of 18. PYTHONPATH=src python compiled_blocks.py"""
import time, mlx.core as mx
from mlx_dflash import load_target
from mlx_dflash import target as target_module
from mlx_dflash.target import Target
from mlx_dflash.models import DEFAULT_MODEL
model = load_target(DEFAULT_MODEL)[0]
t = Target(model, [1, 8, 14, 20, 27])
cache = t.make_cache()
mx.eval(t(mx.array([list(range(100, 400))]), cache, prompt=True))
for M in (4, 8):
    block = mx.array([list(range(500, 500 + M))])
    times = {"compiled": [], "eager": []}
    for i in range(20):
        for name in times:
            target_module.COMPILE_BLOCKS = None if name == "compiled" else False
            tic = time.perf_counter()
            mx.eval(t(block, cache))
            times[name].append(time.perf_counter() - tic)
            t.rollback(cache, M)
    print(M, {k: round(1000 * sorted(v[2:])[9], 1) for k, v in times.items()})
