import time, mlx.core as mx
W = [mx.random.normal((1536, 576)) for _ in range(40)]
W2 = [mx.random.normal((576, 1536)) for _ in range(40)]
mx.eval(W, W2)
def bench(M, f, reps=5):
    x = mx.random.normal((M, 576)); mx.eval(x)
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter(); outs = [f(x, w, w2) for w, w2 in zip(W, W2)]; mx.eval(outs); best = min(best, time.perf_counter() - t)
    return best / 40 * 1e3
for M in (1, 2, 4, 8, 16):
    a = bench(M, lambda x, w, w2: x @ w.T)
    b = bench(M, lambda x, w, w2: x @ w2)
    print(f"M={M:2d}: x@W.T {a:.3f} ms, x@W(pre-transposed) {b:.3f} ms")
