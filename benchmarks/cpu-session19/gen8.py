"""Three HumanEval prompts x 160 tokens (EOS off), run twice, the second timed: DFlash with fixed
blocks or mlx-lm's generate_step. For `perf record` (where_time_goes.txt):
    python gen8.py BLOCK dflash|base"""
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_dflash import generate, load_draft, load_target
from mlx_dflash.bench import humaneval_prompts
from mlx_dflash.data import encode_chat
from mlx_dflash.models import DEFAULT_MODEL, shipped_draft
from mlx_dflash.target import float_dtype

block, mode = int(sys.argv[1]), sys.argv[2]
model, tokenizer = load_target(DEFAULT_MODEL)
draft = load_draft(shipped_draft(DEFAULT_MODEL), dtype=float_dtype(model))
prompts = [encode_chat(tokenizer, p) for p in humaneval_prompts()[:3]]
tokenizer.eos_token_ids = set()


def run() -> None:
    for prompt in prompts:
        if mode == "dflash":
            generate(model, tokenizer, prompt, draft, max_tokens=160, block_size=block)
        else:
            for _ in zip(generate_step(mx.array(prompt), model), range(160)):
                pass


run()
tic = time.perf_counter()
run()
print(mode, block, time.perf_counter() - tic, file=sys.stderr)
