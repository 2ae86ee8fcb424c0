"""One forward of M tokens through mlx-lm's SmolLM2-135M (float32) at 300 positions of context:
median ms of 12, for M = 1, 2, 4, 8, 16. Run under each BLAS (LD_PRELOAD) to compare them."""
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_dflash import load_target
from mlx_dflash.models import DEFAULT_MODEL


def timing(model, M: int, reps: int = 12) -> tuple[float, mx.array]:
    """(median ms, the logits) of a forward of M tokens after a 300-token prompt."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 400))]), cache=cache))
    mx.eval([c.state for c in cache])
    block = mx.array([list(range(500, 500 + M))])
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        out = model(block, cache=cache)
        mx.eval(out)
        times.append(time.perf_counter() - tic)
        for c in cache:
            c.trim(M)
    times.sort()
    return 1000 * times[len(times) // 2], out


if __name__ == "__main__":
    model = load_target(DEFAULT_MODEL)[0]
    print(" ".join(f"M={M}: {timing(model, M)[0]:.1f} ms" for M in (1, 2, 4, 8, 16)))
