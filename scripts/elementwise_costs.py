"""What a verify block multiplies by 16 on this device: elementwise exponentials. Times an add,
an exp, mlx-lm's SwiGLU and the attention softmax for 1 and for 16 rows, 30 layers' worth at
SmolLM2-135M's sizes (MLP 1,536, 9 heads, 272 keys), one evaluation each.

    python scripts/elementwise_costs.py    # on Linux CPUs with the OpenBLAS LD_PRELOAD

On this 2-core x86 CPU MLX's exp is scalar (~14.5 ns an element, an add ~0.2 ns), which makes
SiLU and the softmax most of a 16-token verify's extra cost (BENCHMARKS.md, eleventh session).
"""


import mlx.core as mx
from mlx_lm.models.activations import swiglu

from mlx_dflash.scale import milliseconds_per_call

LAYERS, MLP, HEADS, KEYS = 30, 1536, 9, 272


def ms(fn) -> float:
    return milliseconds_per_call(lambda: mx.eval(fn()), 20)


print(f"{mx.default_device()}, MLX {mx.__version__}, float32, {LAYERS} layers' worth")
for rows in (1, 16):
    x, y = mx.random.normal((LAYERS, rows, MLP)), mx.random.normal((LAYERS, rows, MLP))
    scores = mx.random.normal((LAYERS, HEADS, rows, KEYS))
    mx.eval(x, y, scores)
    print(f"{rows:2d} rows: add {ms(lambda: x + y):6.2f} ms, exp {ms(lambda: mx.exp(x)):6.2f} ms, "
          f"SwiGLU {ms(lambda: swiglu(x, y)):6.2f} ms, softmax over {KEYS} keys "
          f"{ms(lambda: mx.softmax(scores, axis=-1, precise=True)):6.2f} ms", flush=True)
