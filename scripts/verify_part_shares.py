"""Where a verify's time goes: the whole target forward (through ``Target``, as the engine runs
it) for one token and for a block at a given context, then again with one kind of part switched
off on this model instance (its Gated DeltaNet mixers, its attention, its MLPs or its output
head replaced by zeros), so that each part's share of the block's extra cost shows.

    python scripts/verify_part_shares.py [--shape qwen3.5-9b] [--quant 4] [--context 1024] [--block 16]
    python scripts/verify_part_shares.py --model smollm2-135m     # a real model (on Linux CPUs
                                                                   # with the OpenBLAS LD_PRELOAD)

Measured (BENCHMARKS.md, eleventh session): at Qwen3.5-9B's shape on an H200 a 16-token forward
costs 1.06 one-token forwards in bf16, 1.75 in 4-bit (MLX's quantized matmul for 16 rows);
SmolLM2-135M on a 2-core CPU 1.77 at 256 tokens of context, two thirds of the difference in
MLX's scalar exponential (SiLU, the attention softmax).
"""

import argparse

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from mlx_dflash.scale import milliseconds_per_call, random_target
from mlx_dflash.target import Target, load_target

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="qwen3.5-9b", help="scale mode's random target of this shape")
parser.add_argument("--model", help="a real target instead (registered name, folder or Hugging Face id)")
parser.add_argument("--quant", type=int, choices=[4, 8])
parser.add_argument("--context", type=int, default=1024)
parser.add_argument("--block", type=int, default=16)
parser.add_argument("--iters", type=int, default=20)
args = parser.parse_args()


class Zeros(nn.Module):
    """A part switched off: its output is zeros of its input's shape, computed FROM its input.
    (``mx.zeros_like(x)`` does not depend on ``x``: with the output head switched off so, nothing
    evaluated the layers after the last tapped one, and the eleventh session read "no output
    head: 2.96 ms of 10.45" as a 7.5 ms head; alone the head costs 0.6-0.75 ms on the H200,
    scripts/head_costs.py.)"""

    def __call__(self, x, *args, **kwargs):
        return x * 0


model = load_target(args.model)[0] if args.model else random_target(args.shape, quant=args.quant)[0]
target = Target(model, [1])
cache = target.make_cache()
target(mx.random.randint(0, target.vocab_size, (1, args.context)).astype(mx.uint32), cache)
mx.eval([c.state for c in cache])
recurrent = [(c, list(c.cache)) for c in cache if isinstance(c, ArraysCache)]
attention = [(c, c.offset) for c in cache if not isinstance(c, ArraysCache)]


def forward_ms(length: int) -> float:
    tokens = mx.random.randint(0, target.vocab_size, (1, length)).astype(mx.uint32)

    def once():
        logits, features = target(tokens, cache)
        mx.eval(mx.argmax(logits, axis=-1), features)
        for c, arrays in recurrent:  # back to the context's end, whatever ran
            c.cache = list(arrays)
        for c, offset in attention:
            c.trim(c.offset - offset)

    return milliseconds_per_call(once, args.iters)


layers = [target._decoder_layer(i) for i in range(len(target.model.layers))]
lm = target.text_model
parts = {
    "everything": [],
    "no Gated DeltaNet mixers": [(layer, "linear_attn") for layer in layers if hasattr(layer, "linear_attn")],
    "no attention": [(layer, "self_attn") for layer in layers if hasattr(layer, "self_attn")],
    "no MLPs": [(layer, "mlp") for layer in layers],
    "no output head": [(lm, "lm_head")] if hasattr(lm, "lm_head") else [],
}
name = args.model or f"{args.shape}{f' {args.quant}-bit' if args.quant else ''}"
print(f"{mx.default_device()}, MLX {mx.__version__}, {name}, "
      f"context {args.context}, ms per forward")
for name, switched_off in parts.items():
    kept = [(owner, attr, getattr(owner, attr)) for owner, attr in switched_off]
    for owner, attr in switched_off:
        setattr(owner, attr, Zeros())
    one, block = forward_ms(1), forward_ms(args.block)
    print(f"{name:26s} 1 token {one:7.2f}, {args.block} tokens {block:7.2f}, difference {block - one:6.2f}",
          flush=True)
    for owner, attr, part in kept:
        setattr(owner, attr, part)
