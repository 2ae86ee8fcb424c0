import time, mlx.core as mx
def t(f, reps=10):
    f(); best=1e9
    for _ in range(reps):
        a=time.perf_counter(); f(); best=min(best, time.perf_counter()-a)
    return best*1e3
for L in (1, 16):
    q = mx.random.normal((1, 9, L, 64)); k = mx.random.normal((1, 3, 316, 64)); v = mx.random.normal((1, 3, 316, 64))
    mask = mx.arange(316)[None] <= (300 + mx.arange(L))[:, None]
    mx.eval(q, k, v, mask)
    for name, m in (("none", None), ("causal", "causal" if L > 1 else None), ("array", mask)):
        f = lambda: mx.eval([mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m) for _ in range(30)])
        print(f"L={L} mask={name}: {t(f):.2f} ms for 30 layers")
    x = mx.random.normal((L, 1536)); mx.eval(x)
    print(f"L={L} silu 30 layers: {t(lambda: mx.eval([mx.sigmoid(x) * x for _ in range(30)])):.2f} ms")
    xq = mx.random.normal((1, 9, L, 64)); mx.eval(xq)
    print(f"L={L} rope x60: {t(lambda: mx.eval([mx.fast.rope(xq, 64, traditional=False, base=10000., scale=1., offset=300) for _ in range(60)])):.2f} ms")
    xn = mx.random.normal((1, L, 576)); w = mx.ones((576,)); mx.eval(xn, w)
    print(f"L={L} rms_norm x61: {t(lambda: mx.eval([mx.fast.rms_norm(xn, w, 1e-5) for _ in range(61)])):.2f} ms")
