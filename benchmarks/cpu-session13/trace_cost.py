import time, mlx.core as mx
from mlx_dflash import rollback, target as tm
from mlx_dflash.target import Target, load_target
rollback.PAD_READS = True
tm.COMPILE_BLOCKS = True
model, tok = load_target("smollm2-135m")
t = Target(model, [1, 8, 15, 22, 29])
for ctx in (300, 600, 900):
    cache = t.make_cache()
    prompt = mx.array([[(7 * i) % 1000 for i in range(ctx)]])
    mx.eval(t(prompt, cache)[0])
    times = []
    for n in (16, 16, 16, 8, 8, 8):
        a = time.perf_counter(); out = t(mx.array([[5] * n]), cache); b = time.perf_counter(); mx.eval(out, [c.keys for c in cache]); c_ = time.perf_counter()
        times.append((n, round(1e3 * (b - a), 1), round(1e3 * (c_ - b), 1)))
        t.rollback(cache, n)
    print(f"context {ctx} (buffer {cache[0].keys.shape[2]}): (block, build ms, eval ms) {times}", flush=True)
