"""What MLX's CPU backend pays per element for exp-based ops, next to cheap ones and to an exp
built from cheap ones (range reduction and a polynomial, compiled).

    python scripts/elementwise_exp.py

On Linux x86 the mlx-cpu wheel has no SIMD kernels for transcendental functions (upstream PR
ml-explore/mlx#3019 proposes AVX2), so softmax and SiLU, the elementwise work that grows with a
verify's 16 rows, cost ~25-30 ns an element there against ~2 for a multiply. The polynomial form
is a measurement of what a vectorized exp would save, not something the engine uses: it is not
the model's own exp (relative error printed), and the softmax sits inside mlx-lm's attention.
"""

import time

import mlx.core as mx

x = mx.random.normal((9, 16, 316))  # SmolLM2-135M's attention scores for a 16-token block at 316 keys
mx.eval(x)


def ns_per_element(fn, iters: int = 100) -> float:
    mx.eval(fn(x))
    tic = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn(x))
    return (time.perf_counter() - tic) / iters / x.size * 1e9


def polynomial_exp(v: mx.array) -> mx.array:
    """exp(v) = 2^k 2^f, k = floor(v log2 e), 2^f by a degree-6 polynomial on [0, 1)."""
    y = v * 1.4426950408889634
    k = mx.floor(y)
    f = y - k
    p = mx.array(1.5353362e-4)
    for c in (1.3398874e-3, 9.6180345e-3, 5.5503378e-2, 2.4022652e-1, 6.9314720e-1, 1.0):
        p = p * f + c
    return p * ((k.astype(mx.int32) + 127) << 23).view(mx.float32)


print(f"MLX {mx.__version__}, {mx.default_device()}, {x.size} elements")
for name, fn in [("exp", mx.exp), ("softmax", lambda v: mx.softmax(v, axis=-1)), ("sigmoid", mx.sigmoid),
                 ("multiply", lambda v: v * v), ("add", lambda v: v + v),
                 ("polynomial exp, eager", polynomial_exp), ("polynomial exp, compiled", mx.compile(polynomial_exp))]:
    print(f"{name:26s} {ns_per_element(fn):6.2f} ns/element", flush=True)
z = mx.clip(x * 10, -80, 80)
error = (mx.abs(mx.compile(polynomial_exp)(z) - mx.exp(z)) / mx.exp(z)).max().item()
print(f"polynomial exp: max relative error {error:.2e} against mx.exp")
