"""Compiled 8-token verifies on the CPU with key buffers grown in steps of S (256: mlx-lm's)."""
import sys, time
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_dflash import load_draft, load_target
from mlx_dflash.models import DEFAULT_MODEL, shipped_draft
from mlx_dflash.target import Target
step = int(sys.argv[1])
KVCache.step = step  # (experiment only)
model, tok = load_target(DEFAULT_MODEL)
draft = load_draft(shipped_draft(DEFAULT_MODEL), dtype=mx.float32)
target = Target(model, draft.config.target_layer_ids)
cache = target.make_cache()
out = target(mx.array([list(range(100, 260))]), cache, prompt=True); mx.eval(out, [c.state for c in cache])
blk = mx.array([list(range(600, 608))])
times, firsts = [], []
pos = 160
while pos < 560:
    t = time.perf_counter(); out = target(blk, cache); mx.eval(out); dt = time.perf_counter() - t
    before = cache[0].keys.shape[2]
    target.rollback(cache, 4)  # keep 4 of 8: move on 4 positions per cycle
    pos += 4
    times.append(dt)
print(f"step {step}: median verify-8 {1000*sorted(times)[len(times)//2]:.1f} ms, mean {1000*sum(times)/len(times):.1f} ms, "
      f"max {1000*max(times):.1f} ms over {len(times)} cycles, total {sum(times):.2f} s")
