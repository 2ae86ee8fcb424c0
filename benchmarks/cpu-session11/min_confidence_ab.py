import sys
from collections import defaultdict
from mlx_dflash import generate, load_draft, load_target
from mlx_dflash.bench import humaneval_prompts, run_mlx_lm
from mlx_dflash.data import encode_chat
from mlx_dflash.policy import BlockPolicy
from mlx_dflash.target import float_dtype
model, tok = load_target("smollm2-135m")
draft = load_draft("src/mlx_dflash/drafts/smollm2-135m", dtype=float_dtype(model))
prompts = [encode_chat(tok, t) for t in humaneval_prompts()[:4]]
thresholds = [float(x) for x in sys.argv[1:]] or [0.3]
shared = BlockPolicy(16)
methods = {"fixed16": dict(), "adaptive": dict(adaptive=shared)}
methods.update({f"conf{t}": dict(min_confidence=t) for t in thresholds})
for p in prompts[:1]:
    run_mlx_lm(model, tok, p, 64)
    for kw in methods.values():
        generate(model, tok, p, draft, max_tokens=64, **kw)
for rnd in range(2):
    tot = defaultdict(lambda: [0, 0.0]); acc = defaultdict(list)
    for p in prompts:
        ref, _, dec, _ = run_mlx_lm(model, tok, p, 256)
        tot["mlx-lm"][0] += len(ref); tot["mlx-lm"][1] += dec
        for name, kw in methods.items():
            r = generate(model, tok, p, draft, max_tokens=256, **kw)
            assert r.tokens == ref, name
            tot[name][0] += len(r.tokens); tot[name][1] += r.decode_seconds; acc[name] += r.acceptance_lengths
    base = tot["mlx-lm"][0] / tot["mlx-lm"][1]
    print(f"round {rnd}: mlx-lm {base:.2f} tok/s; " + "; ".join(
        f"{n} {v[0]/v[1]/base:.3f}x (acc {sum(acc[n])/len(acc[n]):.2f})" for n, v in tot.items() if n != "mlx-lm"), flush=True)
