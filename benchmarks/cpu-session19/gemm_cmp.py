"""x @ w.T for SmolLM2-135M's float32 projection shapes and its head, M = 1, 8, 16 rows: ms per product
under whichever BLAS is preloaded (blas_libraries.txt)."""
import time
import mlx.core as mx
def t(f, n=100):
    for _ in range(5): f()
    s=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1000
out = []
for N, K in ((1536, 576), (576, 1536), (576, 576), (192, 576), (49152, 576)):
    w = mx.random.normal((N, K), key=mx.random.key(N + K)); mx.eval(w)
    row = []
    for M in (1, 8, 16):
        x = mx.random.normal((M, K), key=mx.random.key(M)); mx.eval(x)
        row.append(f"M={M}: {t(lambda: mx.eval(x @ w.T), 30 if N > 10000 else 200):.3f}")
    print(f"{N}x{K}", " | ".join(row))
