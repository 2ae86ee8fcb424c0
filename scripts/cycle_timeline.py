"""Where a cycle's wall time goes: the host building and launching graphs, or waiting for the device.

    python scripts/cycle_timeline.py [--model M] [--draft D] [--prompt-index 0 1] [--tokens 512] [--block-size 16]
    python scripts/cycle_timeline.py --scale qwen3.5-9b --replay-mean 6.5 [--tokens 1024]

Times one generation per prompt with these host phases measured inside it (by wrapping, for
this script only, the target's forward, the draft's proposal and ``mx.async_eval``): building
the target's and the draft's graphs, and handing them to the device. A cycle's wall time minus
those is the host waiting for the device (or doing bookkeeping). The same for mlx-lm's own decode
step (its model call and its ``mx.async_eval``). If the waits are near zero, the host is the
bottleneck (a small model on a big GPU: launch-bound) and queueing cycles ahead cannot help;
if they are large, the device is. DFlash's other graph pieces are timed too: the target's
rollback and settle, the draft's context update and settle.

``--scale SHAPE --replay-mean M``: as the benchmark's scale mode, a random-weight target of that
shape, one random 128-token prompt, and a random draft that runs every cycle, its proposals
replaced by mlx-lm's greedy tokens corrupted to a mean acceptance of M (``replay.py``).
"""

import argparse
import time
from collections import defaultdict

import mlx.core as mx

from mlx_dflash import engine, generate
from mlx_dflash.bench import humaneval_prompts, run_mlx_lm
from mlx_dflash.data import encode_chat, read_prompts
from mlx_dflash.draft import load_draft
from mlx_dflash.models import DEFAULT_MODEL, shipped_draft
from mlx_dflash.replay import ReplayProposer, geometric_schedule
from mlx_dflash.scale import null_tokenizer, random_draft, random_target
from mlx_dflash.target import Target, float_dtype, load_target

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=DEFAULT_MODEL)
parser.add_argument("--draft", default=None, help="default: the draft shipped for --model")
parser.add_argument("--prompts", default=None, help="JSONL prompts (default: the bench's HumanEval set)")
parser.add_argument("--prompt-index", type=int, nargs="+", default=[0])
parser.add_argument("--tokens", type=int, default=512)
parser.add_argument("--block-size", type=int, default=None)
parser.add_argument("--scale", default=None, help="a scale-mode shape (random weights) instead of --model")
parser.add_argument("--replay-mean", type=float, default=6.5, help="with --scale: the replay's mean acceptance")
args = parser.parse_args()

if args.scale:
    model, config = random_target(args.scale)
    tokenizer = null_tokenizer(config["vocab_size"])
    draft = random_draft(config, block_size=args.block_size or 16)
    prompts = [mx.random.randint(0, config["vocab_size"], (128,), key=mx.random.key(0)).tolist()]
else:
    model, tokenizer = load_target(args.model)
    draft = load_draft(args.draft or shipped_draft(args.model), dtype=float_dtype(model))
    prompts = [encode_chat(tokenizer, t) for t in (read_prompts(args.prompts) if args.prompts else humaneval_prompts())]

spent: dict[str, float] = defaultdict(float)


def timed(name, fn):
    def wrapper(*a, **k):
        tic = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.perf_counter() - tic
    return wrapper


# the script's own instrumentation (measurement only): these names are looked up at call time
mx.async_eval = timed("launch (async_eval)", mx.async_eval)
Target.__call__ = timed("target graph", Target.__call__)
Target.rollback = timed("target rollback", Target.rollback)
Target.settle = timed("target settle", Target.settle)
engine.DFlashProposer.propose = timed("draft graph", engine.DFlashProposer.propose)
engine.DFlashProposer.add_context = timed("draft context", engine.DFlashProposer.add_context)
engine.DFlashProposer.settle = timed("draft settle", engine.DFlashProposer.settle)
model_call = type(model).__call__
type(model).__call__ = timed("model graph", model_call)

for index in args.prompt_index:
    prompt = prompts[index]
    proposer = draft
    if args.scale:
        reference = run_mlx_lm(model, tokenizer, prompt, args.tokens)[0]
        schedule = geometric_schedule(args.replay_mean, draft.block_size)
        proposer = ReplayProposer(prompt + reference, draft.block_size, schedule, config["vocab_size"],
                                  cost_of=engine.DFlashProposer(draft))
    for name, run in [
        ("mlx-lm", lambda: run_mlx_lm(model, tokenizer, prompt, args.tokens)),
        ("dflash", lambda: generate(model, tokenizer, prompt, proposer, max_tokens=args.tokens,
                                    block_size=args.block_size)),
    ]:
        run()  # warm-up
        spent.clear()
        tic = time.perf_counter()
        result = run()
        wall = time.perf_counter() - tic
        steps = result.cycles if name == "dflash" else len(result[0])
        parts = ", ".join(f"{k} {1000 * v / steps:.2f}" for k, v in sorted(spent.items()))
        extra = f", mean acceptance {result.mean_acceptance_length:.2f}" if name == "dflash" else ""
        print(f"prompt {index} {name}: {steps} steps, wall {1000 * wall / steps:.2f} ms/step (incl. prefill); "
              f"host per step: {parts}{extra}", flush=True)
