# float32 x @ W.T on this CPU, ms per product (run: OPENBLAS_CORETYPE=K LD_PRELOAD=.../openblas-pthread/libblas.so.3 python gemm_kernels.py)
import time, mlx.core as mx
def t(f, it=30):
    for _ in range(3): mx.eval(f())
    tic=time.perf_counter()
    for _ in range(it): mx.eval(f())
    return (time.perf_counter()-tic)/it*1000
for (N,K) in [(1536,576),(49152,576)]:
    W=mx.random.normal((N,K)); mx.eval(W)
    row=[]
    for M in [1,4,16,64]:
        x=mx.random.normal((M,K)); mx.eval(x)
        row.append(f"M={M}: {t(lambda: x@W.T):.3f}")
    print(N,K," ".join(row))
