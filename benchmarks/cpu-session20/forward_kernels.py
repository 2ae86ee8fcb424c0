"""One forward of M tokens through mlx-lm's SmolLM2-135M (float32) at 300 positions of context,
its own code against the same code with cpu_kernels installed (``BlockKernels``), alternating
in one process: median ms of 22 each, for M = 1, 4, 8, 16, and the largest logit difference.
    OPENBLAS_CORETYPE=SkylakeX LD_PRELOAD=.../openblas-pthread/libblas.so.3 PYTHONPATH=src python forward_kernels.py"""
import time
from contextlib import nullcontext

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_dflash import load_target
from mlx_dflash.cpu_kernels import BlockKernels
from mlx_dflash.models import DEFAULT_MODEL

model = load_target(DEFAULT_MODEL)[0]
kernels = BlockKernels(model)
cache = make_prompt_cache(model)
mx.eval(model(mx.array([list(range(100, 400))]), cache=cache))
for M in (1, 4, 8, 16):
    block = mx.array([list(range(500, 500 + M))])
    times, logits = {"mlx-lm": [], "cpu_kernels": []}, {}
    for _ in range(24):
        for name in times:
            with kernels.installed() if name == "cpu_kernels" else nullcontext():
                tic = time.perf_counter()
                logits[name] = model(block, cache=cache)
                mx.eval(logits[name])
                times[name].append(time.perf_counter() - tic)
            for c in cache:
                c.trim(M)
    median = {name: 1000 * sorted(t[2:])[len(t[2:]) // 2] for name, t in times.items()}
    gap = mx.abs(logits["mlx-lm"] - logits["cpu_kernels"]).max().item()
    print(f"M={M:2d}: mlx-lm {median['mlx-lm']:.1f} ms, cpu_kernels {median['cpu_kernels']:.1f} ms "
          f"({median['cpu_kernels'] / median['mlx-lm']:.3f}); largest logit difference {gap:.2e}", flush=True)
