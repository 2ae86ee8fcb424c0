"""One process of a sharded run, started by tests/test_sharded.py through ``mlx.launch -n 2
--backend ring``: OUT FOLDER... (each folder a tiny target and draft: FOLDER/target, FOLDER/draft);
writes OUT/process-RANK.json with each folder's tokens on every path."""

import json
import sys
from pathlib import Path

import mlx.core as mx

from mlx_dflash import EngineOptions, SamplingParams, generate, load
from mlx_dflash.distributed import world

PROMPT = "def fib(n):"
MAX_TOKENS = 6
PATHS = {
    "fixed": {"adaptive": False},
    "adaptive": {"adaptive": True},
    "block1": {"adaptive": False, "block_size": 1},
    "gpu_paths": {"adaptive": True, "options": EngineOptions(queue_ahead=True, compile_blocks=True, pad_reads=True)},
    "top_k1": {"adaptive": True, "sampling": SamplingParams(temp=1.0, top_k=1)},
    "sampled": {"adaptive": True, "sampling": SamplingParams(temp=1.0)},  # (no seed: one is shared)
}

if __name__ == "__main__":
    out, folders = Path(sys.argv[1]), sys.argv[2:]
    group = world()
    results = {"size": group.size(), "runs": {}}
    for folder in folders:
        model, tokenizer, draft = load(str(Path(folder, "target")), str(Path(folder, "draft")), group=group)
        tokenizer.eos_token_ids = set()
        prompt = tokenizer.encode(PROMPT)
        results["runs"][folder] = {name: generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, **kwargs).tokens
                                   for name, kwargs in PATHS.items()}
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # (both done before either writes)
    Path(out, f"process-{group.rank()}.json").write_text(json.dumps(results))
