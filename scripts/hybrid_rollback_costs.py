"""One Gated DeltaNet layer at Qwen3.5-9B dims: a 16-token verify and the rollback to k
accepted tokens, then a prompt's prefill; mlx-lm's own mixer (token-by-token recurrence,
rollback by replaying the accepted tokens) against delta_rule.BlockDeltaMixer in its two forms:
chunked (rollback by one matmul) and stepwise (on CUDA our one-launch kernel; rollback reads
the state it saved after each token). Run: python scripts/hybrid_rollback_costs.py [--iters 10]
[--prompt-len 512] [--compile] (on Linux, with OpenBLAS in LD_PRELOAD as `mlx-dflash doctor`
describes; on a GPU as is). --compile: the chunked mixer's verify + rewind again with
delta_rule's two functions under mx.compile (fewer, fused kernels: a candidate for GPUs, where
the chunked form's ~40 small ops per layer may be launch-bound)."""

import argparse

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from mlx_dflash import delta_rule
from mlx_dflash.delta_rule import BlockDeltaMixer
from mlx_dflash.scale import milliseconds_per_call

parser = argparse.ArgumentParser()
parser.add_argument("--iters", type=int, default=10)
parser.add_argument("--prompt-len", type=int, default=512)
parser.add_argument("--compile", action="store_true")
args = parser.parse_args()

config = TextModelArgs(model_type="qwen3_5", hidden_size=4096, intermediate_size=12288, num_hidden_layers=4,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_value_heads=32,
                       linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=1000)
layer = DecoderLayer(config, 0)
mx.eval(layer.parameters())
mlx_lm_mixer = layer.linear_attn
block_mixer = BlockDeltaMixer(mlx_lm_mixer, stepwise=False)
stepwise_mixer = BlockDeltaMixer(mlx_lm_mixer, stepwise=True)
block = layer.input_layernorm(mx.random.normal((1, 16, 4096)))
history = ArraysCache(size=2)
mlx_lm_mixer(layer.input_layernorm(mx.random.normal((1, 32, 4096))), None, history)
mx.eval(history.cache)


def cache_copy() -> ArraysCache:
    cache = ArraysCache(size=2)
    cache.cache = list(history.cache)
    return cache


def timed(fn) -> float:
    return milliseconds_per_call(fn, args.iters)


def mlx_lm_cycle(keep: int):
    def run():
        cache = cache_copy()
        mx.eval(mlx_lm_mixer(block, None, cache), cache.cache)
        if keep < 16:  # rollback: the state before the block, advanced over the accepted tokens
            cache = cache_copy()
            mlx_lm_mixer(block[:, :keep], None, cache)
            mx.eval(cache.cache)
    return run


def block_cycle(keep: int, mixer: BlockDeltaMixer = block_mixer):
    def run():
        cache = cache_copy()
        mx.eval(mixer(block, None, cache), cache.cache)
        if keep < 16:
            mixer.rewind(cache, keep)
            mx.eval(cache.cache)
    return run


def prefill(mixer, prompt: mx.array):
    def run():
        cache = ArraysCache(size=2)
        mx.eval(mixer(prompt, None, cache), cache.cache)
    return run


print(f"{mx.default_device()}, one Gated DeltaNet layer at Qwen3.5-9B dims, ms per verify of 16 tokens + rollback")
for keep in (16, 8, 1):
    print(f"keep {keep:2d}: mlx-lm mixer + replay {timed(mlx_lm_cycle(keep)):6.1f} ms, "
          f"chunked mixer + rewind {timed(block_cycle(keep)):6.1f} ms, "
          f"stepwise mixer + rewind {timed(block_cycle(keep, stepwise_mixer)):6.1f} ms")
prompt = layer.input_layernorm(mx.random.normal((1, args.prompt_len, 4096)))
print(f"prefill of {args.prompt_len} tokens: mlx-lm mixer {timed(prefill(mlx_lm_mixer, prompt)):6.1f} ms, "
      f"chunked mixer {timed(prefill(block_mixer, prompt)):6.1f} ms, "
      f"stepwise mixer {timed(prefill(stepwise_mixer, prompt)):6.1f} ms")
if args.compile:  # the module's functions, replaced for this process only
    delta_rule.chunk_delta_rule = mx.compile(delta_rule.chunk_delta_rule)
    delta_rule.state_after = mx.compile(delta_rule.state_after)
    for keep in (16, 8, 1):
        print(f"keep {keep:2d}: chunked mixer + rewind, compiled {timed(block_cycle(keep)):6.1f} ms")
