"""Record the independent reference that tests/test_models.py checks against.

Run once, by hand, in an environment with torch + transformers + gguf (not a
project dependency): transformers dequantizes the same GGUF and runs its own
PyTorch implementation of the model and its own GGUF tokenizer conversion.

    python tests/reference/record_gguf_reference.py GGUF_FILE NAME > tests/reference/NAME.json
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tricky_strings import TRICKY_STRINGS

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "List three colours of the rainbow.",
]
NEW_TOKENS = 32


def main(gguf_file: str, name: str) -> None:
    path = Path(gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    cases = []
    for prompt in PROMPTS:
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:  # a base model: the plain prompt (with BOS where the tokenizer adds one)
            ids = tokenizer.encode(prompt)
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        cases.append({"prompt": prompt, "chat": bool(tokenizer.chat_template), "prompt_ids": ids,
                      "continuation": out[0, len(ids):].tolist()})
    encodings = {s: tokenizer.encode(s, add_special_tokens=False) for s in TRICKY_STRINGS}
    json.dump({"model": name, "reference": f"transformers {__import__('transformers').__version__}, torch "
               f"{torch.__version__}, float32, greedy", "generations": cases, "encodings": encodings},
              sys.stdout, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main(*sys.argv[1:])
