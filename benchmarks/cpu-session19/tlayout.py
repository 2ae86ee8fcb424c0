import time
import mlx.core as mx
import mlx.nn as nn
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
    ts.sort(); return 1000 * ts[len(ts)//2], out
res = {}
for M in (1, 8):
    res[M] = timing(M)
    print("original", M, f"{res[M][0]:.1f} ms")
n = 0
for name, m in model.named_modules():
    if isinstance(m, nn.Linear) and not isinstance(m, nn.QuantizedLinear):
        m.weight = mx.contiguous(m.weight.T).T; n += 1
emb = model.model.embed_tokens
emb_t = None
mx.eval(model.parameters())
print("converted", n)
for M in (1, 8):
    ms, out = timing(M)
    print("transposed storage", M, f"{ms:.1f} ms", "same logits:", mx.array_equal(out, res[M][1]).item(), "max diff", mx.abs(out - res[M][1]).max().item())
