"""Does the draft generalise? Mean acceptance on HumanEval, on prompts it never saw and on
prompts it was trained on (run with PYTHONPATH=src):

    python scripts/acceptance_sets.py [--draft DRAFT] \
        [--unseen PROMPTS.jsonl.gz] [--trained SEQUENCES.jsonl.gz] [--num 6] [--tokens 256]

Unseen: a prompt file of stage_all.sh (the completion requests with doctest examples, the
ones most like HumanEval); trained: a saved data set (its records' prompts); without them,
HumanEval only (--num 164: all of it). Default draft: the embedded model's shipped one;
16-token blocks, greedy, EOS on. Prints the mean acceptance length over all cycles and the
acceptance rate by draft position. On Linux CPUs use the OpenBLAS LD_PRELOAD that
`mlx-dflash doctor` prints.
"""

import argparse
import gzip
import json
import random

from tqdm import tqdm

from mlx_dflash import generate, load_draft, load_target
from mlx_dflash.bench import acceptance_by_position, humaneval_prompts
from mlx_dflash.data import encode_chat
from mlx_dflash.models import DEFAULT_MODEL, shipped_draft
from mlx_dflash.target import float_dtype

parser = argparse.ArgumentParser()
parser.add_argument("--draft", default=None)
parser.add_argument("--unseen", default=None)
parser.add_argument("--trained", default=None)
parser.add_argument("--num", type=int, default=6)
parser.add_argument("--tokens", type=int, default=256)
args = parser.parse_args()

model, tok = load_target(DEFAULT_MODEL)
draft = load_draft(args.draft or shipped_draft(DEFAULT_MODEL), dtype=float_dtype(model))
rng = random.Random(0)
sets = {"HumanEval": [encode_chat(tok, p) for p in humaneval_prompts()[: args.num]]}
if args.unseen:
    unseen = [json.loads(line)["prompt"] for line in gzip.open(args.unseen, "rt")]
    unseen = rng.sample([p for p in unseen if "```python" in p and ">>>" in p], args.num)
    sets["unseen completion requests with examples"] = [encode_chat(tok, p) for p in unseen]
if args.trained:
    trained = rng.sample([json.loads(line) for line in gzip.open(args.trained, "rt")], args.num)
    sets["trained prompts"] = [r["tokens"][: r["prompt_len"]] for r in trained]
for name, prompts in sets.items():
    accepted = []
    for prompt in tqdm(prompts, desc=name, leave=False):
        accepted += generate(model, tok, prompt, draft, max_tokens=args.tokens).acceptance_lengths
    by_position = acceptance_by_position(accepted, block_size=8)
    print(f"{name}: {len(prompts)} prompts, {len(accepted)} cycles, mean acceptance "
          f"{sum(accepted) / len(accepted):.2f}, by position {' / '.join(f'{p:.3f}' for p in by_position)}",
          flush=True)
