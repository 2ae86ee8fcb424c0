"""float32 products of 1-16 rows on this CPU (OpenBLAS), ms, median: separate gate/up and q/k/v products vs one packed."""
import time, mlx.core as mx
def t(f, n=80):
    for _ in range(5): mx.eval(f())
    ts=[]
    for _ in range(n):
        a=time.perf_counter(); mx.eval(f()); ts.append(time.perf_counter()-a)
    ts.sort(); return 1000*ts[len(ts)//2]
for parts in [(1536,1536),(576,192,192)]:
    i=576
    Ws=[mx.random.normal((o,i)) for o in parts]; P=mx.concatenate(Ws,0); mx.eval(Ws,P)
    row=[]
    for m in [1,4,8,16]:
        x = mx.random.normal((1,m,i)); mx.eval(x)
        a=t(lambda: [x @ W.T for W in Ws]); b=t(lambda: x @ P.T)
        row.append(f"m{m}: sep {a:.3f} packed {b:.3f}")
    print(parts, " | ".join(row), flush=True)
