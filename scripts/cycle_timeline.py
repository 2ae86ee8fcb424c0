"""Where a cycle's wall time goes: the host building and launching graphs, or waiting for the device.

    python scripts/cycle_timeline.py [--model M] [--draft D] [--prompt-index 0 1] [--tokens 512] [--block-size 16]

Times one generation per prompt with these host phases measured inside it (by wrapping, for
this script only, the target's forward, the draft's proposal and ``mx.async_eval``): building
the target's and the draft's graphs, and handing them to the device. A cycle's wall time minus
those is the host waiting for the device (or doing bookkeeping). The same for mlx-lm's own decode
step (its model call and its ``mx.async_eval``). If the waits are near zero, the host is the
bottleneck (a small model on a big GPU: launch-bound) and queueing cycles ahead cannot help;
if they are large, the device is.
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
from mlx_dflash.target import Target, float_dtype, load_target

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=DEFAULT_MODEL)
parser.add_argument("--draft", default=None, help="default: the draft shipped for --model")
parser.add_argument("--prompts", default=None, help="JSONL prompts (default: the bench's HumanEval set)")
parser.add_argument("--prompt-index", type=int, nargs="+", default=[0])
parser.add_argument("--tokens", type=int, default=512)
parser.add_argument("--block-size", type=int, default=None)
args = parser.parse_args()

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
engine.DFlashProposer.propose = timed("draft graph", engine.DFlashProposer.propose)
model_call = type(model).__call__
type(model).__call__ = timed("model graph", model_call)

for index in args.prompt_index:
    prompt = prompts[index]
    for name, run in [
        ("mlx-lm", lambda: run_mlx_lm(model, tokenizer, prompt, args.tokens)),
        ("dflash", lambda: generate(model, tokenizer, prompt, draft, max_tokens=args.tokens,
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
