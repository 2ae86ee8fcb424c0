import time, mlx.core as mx
H = mx.random.normal((49152, 576)); mx.eval(H)
for M in (1, 4, 16, 32, 64):
    x = mx.random.normal((M, 576)); mx.eval(x)
    best = 1e9
    for _ in range(5):
        t = time.perf_counter(); mx.eval(x @ H.T); best = min(best, time.perf_counter() - t)
    print(f"head M={M}: {best*1e3:.2f} ms, {2*M*49152*576/best/1e9:.1f} GFLOP/s")
W = mx.random.normal((1536, 576)); mx.eval(W)
for M in (16, 32, 64, 128):
    x = mx.random.normal((M, 576)); mx.eval(x)
    best = 1e9
    for _ in range(20):
        t = time.perf_counter(); mx.eval(x @ W.T); best = min(best, time.perf_counter() - t)
    print(f"mlp M={M}: {best*1e3:.3f} ms, {2*M*1536*576/best/1e9:.1f} GFLOP/s (weights in cache)")
