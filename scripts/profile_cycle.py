"""Where does a DFlash cycle's time go, per block size? (run with PYTHONPATH=src)

    python scripts/profile_cycle.py [MODEL] [DRAFT] [--blocks 1 2 4 16] [--prompts FILE.jsonl]

For each block size: whole generations at that fixed size (tok/s, ms/cycle, acceptance;
run twice, the first pays one-off costs), then one cycle's phases timed one at a time with
an eval after each: the draft pass, the verify, a plain step through the tapped target and
mlx-lm's own step. Defaults: the embedded model and its shipped draft, HumanEval prompt 1.
On Linux CPUs run it with the OpenBLAS LD_PRELOAD that `mlx-dflash doctor` prints.
"""

import argparse
import json
import time

import mlx.core as mx

from mlx_dflash import generate, load_draft, load_target
from mlx_dflash.bench import humaneval_prompts
from mlx_dflash.data import encode_chat
from mlx_dflash.engine import DFlashProposer
from mlx_dflash.models import DEFAULT_MODEL, shipped_draft
from mlx_dflash.target import Target, float_dtype

parser = argparse.ArgumentParser()
parser.add_argument("model", nargs="?", default=DEFAULT_MODEL)
parser.add_argument("draft", nargs="?", default=None)
parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 16])
parser.add_argument("--prompts", default=None)
parser.add_argument("--tokens", type=int, default=160)
args = parser.parse_args()

model, tok = load_target(args.model)
tok.eos_token_ids = set()
draft_dtype = float_dtype(model)
draft = load_draft(args.draft or shipped_draft(args.model), dtype=draft_dtype)
text = json.loads(open(args.prompts).readline())["prompt"] if args.prompts else humaneval_prompts()[0]
prompt = encode_chat(tok, text)
target = Target(model, draft.config.target_layer_ids)


def timed(fn) -> float:
    tic = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - tic


def phases(block: int, cycles: int = 12) -> dict:
    proposer = DFlashProposer(draft)
    proposer.start(target)
    cache = target.make_cache()
    logits, features = target(mx.array(prompt)[None], cache)
    proposer.add_context(features)
    x = mx.argmax(logits[0, -1], keepdims=True)
    mx.eval(x, proposer.state)
    total = {"draft": 0.0, "verify": 0.0, "plain_tapped": 0.0, "plain_mlx_lm": 0.0}
    for _ in range(cycles):
        drafted = proposer.propose(x, block - 1)
        total["draft"] += timed(lambda: drafted)
        logits, features = target(mx.concatenate([x, drafted.astype(x.dtype)])[None], cache)
        total["verify"] += timed(lambda: (logits, features))
        target.rollback(cache, block - 1)  # keep only the first token: the next phases decode from it
        proposer.add_context(features[:, :1])
        x = mx.argmax(logits[0, :1], axis=-1)
        logits, features = target(x[None], cache)
        total["plain_tapped"] += timed(lambda: (logits, features))
        proposer.add_context(features)
        x = mx.argmax(logits[0, -1:], axis=-1)
        total["plain_mlx_lm"] += timed(lambda: model(x[None], cache=cache))
        target.rollback(cache, 1)
        mx.eval(proposer.state)
    return {k: round(1000 * v / cycles, 1) for k, v in total.items()}


print(f"{args.model} on {mx.default_device()}, draft dtype {draft_dtype}", flush=True)
for block in args.blocks:
    for attempt in range(2):
        r = generate(model, tok, prompt, draft, max_tokens=args.tokens, block_size=block)
        print(f"block {block:2d} run {attempt}: {r.decode_tokens_per_sec:6.1f} tok/s, "
              f"{1000 * r.decode_seconds / max(r.cycles, 1):6.1f} ms/cycle, acceptance "
              f"{sum(r.acceptance_lengths) / max(len(r.acceptance_lengths), 1):.2f}", flush=True)
    if block > 1:
        print(f"block {block:2d} phases ms: {phases(block)}", flush=True)
