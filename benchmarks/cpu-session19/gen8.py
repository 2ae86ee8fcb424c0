import sys, time
import mlx.core as mx
from mlx_dflash import generate, load_draft, load_target
from mlx_dflash.bench import humaneval_prompts
from mlx_dflash.data import encode_chat
from mlx_dflash.models import DEFAULT_MODEL, shipped_draft
from mlx_dflash.target import float_dtype
from mlx_lm.generate import generate_step
block = int(sys.argv[1]); mode = sys.argv[2]
model, tok = load_target(DEFAULT_MODEL)
draft = load_draft(shipped_draft(DEFAULT_MODEL), dtype=float_dtype(model))
prompts = [encode_chat(tok, p) for p in humaneval_prompts()[:3]]
tok.eos_token_ids = set()
def run():
    for p in prompts:
        if mode == "dflash":
            r = generate(model, tok, p, draft, max_tokens=160, block_size=block)
        else:
            for _, n in zip(generate_step(mx.array(p), model), range(160)): pass
run()
t = time.perf_counter(); run(); print(mode, block, time.perf_counter() - t, file=sys.stderr)
