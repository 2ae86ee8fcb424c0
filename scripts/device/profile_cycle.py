"""Where does a DFlash cycle's time go on this machine? (run with PYTHONPATH=src)

Times generate() three times (JIT/warm-up effects), then one cycle's phases one
at a time with an eval after each, for the draft in the target's dtype and in float32.
"""

import json
import sys
import time

import mlx.core as mx

from mlx_dflash import generate, load_draft, load_target
from mlx_dflash.data import encode_chat
from mlx_dflash.engine import DFlashProposer
from mlx_dflash.target import Target

model, tok = load_target(sys.argv[1])
prompt = encode_chat(tok, json.loads(open(sys.argv[3]).readline())["prompt"])


def phases(draft, cycles=40):
    target = Target(model, draft.config.target_layer_ids)
    prop = DFlashProposer(draft)
    prop.start(target)
    cache = target.make_cache()
    logits, feats = target(mx.array(prompt)[None], cache)
    prop.add_context(feats)
    x = mx.argmax(logits[0, -1], keepdims=True)
    mx.eval(x)
    t = {"context": 0.0, "draft": 0.0, "verify": 0.0, "accept": 0.0, "rollback": 0.0}
    for _ in range(cycles):
        tic = time.perf_counter()
        if prop.pending:
            mx.eval(prop.pending)
        t["context"] += time.perf_counter() - tic
        tic = time.perf_counter()
        d = prop.propose(x, 15)
        mx.eval(d, prop.cache[0].keys)
        t["draft"] += time.perf_counter() - tic
        tic = time.perf_counter()
        lg, f = target(mx.concatenate([x, d.astype(x.dtype)])[None], cache)
        c = mx.argmax(lg[0], axis=-1)
        mx.eval(c, f)
        t["verify"] += time.perf_counter() - tic
        tic = time.perf_counter()
        a = mx.cumprod((d == c[:-1]).astype(mx.int32)).sum().item()
        t["accept"] += time.perf_counter() - tic
        tic = time.perf_counter()
        target.rollback(cache, 16 - (a + 1))
        prop.add_context(f[:, : a + 1])
        x = c[a : a + 1]
        t["rollback"] += time.perf_counter() - tic
    return {k: round(1000 * v / cycles, 2) for k, v in t.items()}


for dtype in (None, mx.float32):
    draft = load_draft(sys.argv[2], dtype=dtype or model.model.embed_tokens.weight.dtype)
    for i in range(3):
        r = generate(model, tok, prompt, draft, max_tokens=256)
        print(f"draft {dtype or 'target dtype'} run {i}: {r.cycles} cycles, "
              f"{1000 * r.decode_seconds / max(r.cycles, 1):.1f} ms/cycle, {r.decode_tokens_per_sec:.1f} tok/s", flush=True)
    print("phases ms:", phases(draft), flush=True)
