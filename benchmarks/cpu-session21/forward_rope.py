"""One forward of M tokens through mlx-lm's SmolLM2-135M (float32) at 300 positions of context:
mlx-lm's own code, cpu_kernels' attention and SwiGLU without ``rope`` (the twentieth session's
blocks), and with it; alternating in one process, median ms of 22 each, for M = 1, 8, 16, and
each one's largest logit difference from mlx-lm's. The RoPE tables are made afresh every forward
(in decoding, each block starts at a new offset).
    OPENBLAS_CORETYPE=SkylakeX LD_PRELOAD=.../openblas-pthread/libblas.so.3 PYTHONPATH=src python forward_rope.py"""
import time
from contextlib import nullcontext

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from mlx_dflash import cpu_kernels, load_target
from mlx_dflash.cpu_kernels import BlockKernels
from mlx_dflash.models import DEFAULT_MODEL
from mlx_dflash.projections import swapped

model = load_target(DEFAULT_MODEL)[0]
swaps = BlockKernels(model).swaps
variants = {"mlx-lm": nullcontext, "kernels, no rope": lambda: swapped([s for s in swaps if type(s[2]) is not nn.RoPE]),
            "kernels + rope": lambda: swapped(swaps)}


def timed_forward(installed, block: mx.array, cache: list) -> tuple[float, mx.array]:
    """Seconds and logits of one forward of ``block`` under ``installed``, its cache rolled back
    after, the RoPE tables made afresh."""
    cpu_kernels._rotations.cache_clear()
    with installed():
        tic = time.perf_counter()
        logits = model(block, cache=cache)
        mx.eval(logits)
        seconds = time.perf_counter() - tic
    for layer_cache in cache:
        layer_cache.trim(block.shape[1])
    return seconds, logits


cache = make_prompt_cache(model)
mx.eval(model(mx.array([list(range(100, 400))]), cache=cache))
for M in (1, 8, 16):
    block = mx.array([list(range(500, 500 + M))])
    runs = [{name: timed_forward(installed, block, cache) for name, installed in variants.items()} for _ in range(24)]
    median = {name: 1000 * sorted(run[name][0] for run in runs[2:])[11] for name in variants}
    logits = runs[-1]
    print(f"M={M:2d}: " + ", ".join(
        f"{name} {median[name]:.1f} ms (gap {mx.abs(logits[name][1] - logits['mlx-lm'][1]).max().item():.1e})"
        for name in variants), flush=True)
