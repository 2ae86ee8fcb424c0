"""The draft's mean acceptance per context window: how much of a long prompt the draft should see.

    python tools/window_acceptance.py [--model M] [--draft D] [--context 0 2048] [--windows 128 256 512 768 0]
        [--num-prompts 4] [--max-tokens 256]

HumanEval questions, as they are (context 0) or after source files filling the prompt to N tokens
(as `mlx-dflash bench --context N`), greedy, fixed full blocks; the draft sees 4 sink + the latest
W context positions (window 0: all). Every window commits the target's own tokens, so in float32
the windows are compared on the same texts (the last line says whether they were). No timing:
`mlx-dflash bench --draft-window W` turns a window into speed on a machine.
"""

import argparse

import mlx.core as mx

from mlx_dflash import generate, load, use_fast_blas
from mlx_dflash.bench import humaneval_prompts
from mlx_dflash.bench_prompts import long_context_prompts
from mlx_dflash.data import encode_chat
from mlx_dflash.pair import set_draft_window

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
parser.add_argument("--draft", default=None, help="default: the draft shipped for the model")
parser.add_argument("--context", type=int, nargs="+", default=[0, 2048], help="prompt tokens (0: the questions alone)")
parser.add_argument("--windows", type=int, nargs="+", default=[128, 256, 512, 768, 0])
parser.add_argument("--num-prompts", type=int, default=4)
parser.add_argument("--max-tokens", type=int, default=256)
args = parser.parse_args()

use_fast_blas()
model, tokenizer, draft = load(args.model, args.draft)
questions = humaneval_prompts()[: args.num_prompts]
same_texts = True
print("| window | " + " | ".join(f"context {n or 'of the question'}" for n in args.context) + " |")
print("|---" * (len(args.context) + 1) + "|")
rows: dict[int, list[str]] = {window: [] for window in args.windows}
for context in args.context:
    # (the chat template, as `bench` builds its prompts)
    if context:
        prompts = long_context_prompts(tokenizer, questions, context)
    else:
        prompts = [encode_chat(tokenizer, question) for question in questions]
    texts = None
    for window in args.windows:
        set_draft_window(draft, window)
        results = [generate(model, tokenizer, mx.array(p), draft, max_tokens=args.max_tokens) for p in prompts]
        verifies = [a for result in results for a in result.acceptance_lengths[:-1]]  # (the last may be cut short)
        rows[window].append(f"{sum(verifies) / len(verifies):.2f}" if verifies else "-")
        tokens = [result.tokens for result in results]
        same_texts &= texts is None or tokens == texts
        texts = tokens
for window, cells in rows.items():
    print(f"| {window or 'all'} | " + " | ".join(cells) + " |")
print(f"mean acceptance length, {args.num_prompts} prompts x {args.max_tokens} tokens; "
      f"every window the same texts: {same_texts}")
