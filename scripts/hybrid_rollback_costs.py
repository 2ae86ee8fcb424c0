"""One Gated DeltaNet layer at Qwen3.5-9B dims on this CPU: replay of k accepted tokens vs
the extra cost of keeping the 16 per-step recurrent states of a verify (rollback.py says
why it matters). Run: python scripts/hybrid_rollback_costs.py (on Linux, with OpenBLAS in
LD_PRELOAD as `mlx-dflash doctor` describes)."""
import time
import mlx.core as mx
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs
from mlx_lm.models.cache import ArraysCache
args = TextModelArgs(model_type="qwen3_5", hidden_size=4096, intermediate_size=12288, num_hidden_layers=4,
                     num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_value_heads=32,
                     linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=1000)
layer = DecoderLayer(args, 0)
mx.eval(layer.parameters())
x = mx.random.normal((1, 16, 4096))
def fresh():
    c = ArraysCache(size=2)
    layer.linear_attn(layer.input_layernorm(mx.random.normal((1, 32, 4096))), None, c)
    mx.eval(c.cache)
    return c
def timed(fn, n=10):
    fn(); t = time.perf_counter()
    for _ in range(n): fn()
    return 1000 * (time.perf_counter() - t) / n
base = fresh()
def verify():
    c = ArraysCache(size=2); c.cache = list(base.cache)
    mx.eval(layer.linear_attn(layer.input_layernorm(x), None, c), c.cache)
def replay(k):
    def run():
        c = ArraysCache(size=2); c.cache = list(base.cache)
        layer.linear_attn(layer.input_layernorm(x[:, :k]), None, c); mx.eval(c.cache)
    return run
state = base.cache[1]
def keep_states():  # what saving 16 per-step states writes: 16 copies of [1, 32, 128, 128] float32
    mx.eval(mx.stack([state * (1.0 + i) for i in range(16)]))
print(f"verify 16 tokens (mixer only): {timed(verify):.1f} ms")
for k in (1, 8, 15):
    print(f"replay {k} tokens: {timed(replay(k)):.1f} ms")
print(f"keep 16 per-step states ({16 * state.nbytes / 1e6:.0f} MB): {timed(keep_states):.1f} ms")
