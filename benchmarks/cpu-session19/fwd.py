import time
import mlx.core as mx
from mlx_dflash import load_target
from mlx_dflash.models import DEFAULT_MODEL
from mlx_lm.models.cache import make_prompt_cache
model, tok = load_target(DEFAULT_MODEL)
def timing(M, reps=12):
    cache = make_prompt_cache(model)
    x = mx.array([list(range(100, 400))]); mx.eval(model(x, cache=cache)); mx.eval([c.state for c in cache])
    blk = mx.array([list(range(500, 500 + M))])
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); out = model(blk, cache=cache); mx.eval(out); ts.append(time.perf_counter() - t)
        for c in cache: c.trim(M)
    ts.sort(); return 1000 * ts[len(ts)//2]
print(" ".join(f"M={M}: {timing(M):.1f} ms" for M in (1, 2, 4, 8, 16)))
