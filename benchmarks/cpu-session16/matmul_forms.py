"""float32 products of 1-16 rows on this CPU (OpenBLAS), ms, median: x @ W.T / (W @ x.T).T / x @ Wt (pre-transposed);
then separate gate/up and q/k/v products vs one packed product."""
import time, mlx.core as mx
def t(f, n=60):
    for _ in range(5): mx.eval(f())
    ts=[]
    for _ in range(n):
        a=time.perf_counter(); mx.eval(f()); ts.append(time.perf_counter()-a)
    ts.sort(); return 1000*ts[len(ts)//2]
for (o,i) in [(1536,576),(576,1536),(576,576),(192,576),(49152,576)]:
    W = mx.random.normal((o,i)); Wt = mx.array(W.T); mx.eval(W,Wt)
    row=[]
    for m in [1,2,4,8,16]:
        x = mx.random.normal((1,m,i)); mx.eval(x)
        a=t(lambda: x @ W.T); b=t(lambda: (W @ x[0].T).T); c=t(lambda: x @ Wt)
        row.append(f"m{m}: {a:.3f}/{b:.3f}/{c:.3f}")
    print(f"{o}x{i}", " | ".join(row), flush=True)
for parts in [(1536,1536),(576,192,192)]:
    i=576
    Ws=[mx.random.normal((o,i)) for o in parts]; P=mx.concatenate(Ws,0); mx.eval(Ws,P)
    row=[]
    for m in [1,4,8,16]:
        x = mx.random.normal((1,m,i)); mx.eval(x)
        a=t(lambda: [x @ W.T for W in Ws]); b=t(lambda: x @ P.T)
        row.append(f"m{m}: sep {a:.3f} packed {b:.3f}")
    print(parts, " | ".join(row), flush=True)
