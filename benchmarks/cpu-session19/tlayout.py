"""Tried, not kept: every Linear's weight stored transposed (a view of a contiguous [in, out]
copy), so that OpenBLAS gets no-transpose products. 1 and 8 tokens, before and after."""
import mlx.core as mx
import mlx.nn as nn
from fwd import timing

from mlx_dflash import load_target
from mlx_dflash.models import DEFAULT_MODEL

model = load_target(DEFAULT_MODEL)[0]
before = {M: timing(model, M) for M in (1, 8)}
for M, (ms, _) in before.items():
    print("original", M, f"{ms:.1f} ms")
for _, module in model.named_modules():
    if isinstance(module, nn.Linear) and not isinstance(module, nn.QuantizedLinear):
        module.weight = mx.contiguous(module.weight.T).T
mx.eval(model.parameters())
for M in (1, 8):
    ms, out = timing(model, M)
    print("transposed storage", M, f"{ms:.1f} ms", "same logits:", mx.array_equal(out, before[M][1]).item(),
          "max diff", mx.abs(out - before[M][1]).max().item())
