"""Acceptance at fixed 4- and 8-token blocks when the draft drafts only the block's slots (as the engine does)
vs all 15 slots of its training block, cut to the block (HumanEval prompts 10-15, 128 tokens; CPU, float32)."""
from mlx_dflash import generate, engine
from mlx_dflash.bench import humaneval_prompts
from mlx_dflash.data import encode_chat
from mlx_dflash.draft import load_draft
from mlx_dflash.models import DEFAULT_MODEL, shipped_draft
from mlx_dflash.target import float_dtype, load_target
model, tok = load_target(DEFAULT_MODEL)
draft = load_draft(shipped_draft(DEFAULT_MODEL), dtype=float_dtype(model))
ps = [encode_chat(tok, t) for t in humaneval_prompts()[10:16]]
orig = engine.DFlashProposer.propose
def full(self, first, n):
    return orig(self, first, 15)[:n]
for block in [4, 8]:
    for name, fn in [("as many slots as the block", orig), ("15 slots, cut", full)]:
        engine.DFlashProposer.propose = fn
        acc = []
        for p in ps:
            acc += generate(model, tok, p, draft, max_tokens=128, block_size=block).acceptance_lengths
        print(f"block {block}: {name}: {len(acc)} cycles, mean acceptance {sum(acc) / len(acc):.3f}", flush=True)
