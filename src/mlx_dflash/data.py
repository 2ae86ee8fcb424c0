"""``mlx-dflash data``: a self-distillation set, prompts -> the target's OWN responses.

DFlash drafts learn to predict what the target says, so the training text is
the target's greedy output to a prompt set, stored as token ids with the prompt
length (the loss covers response tokens only).

Prompts must be available offline and must not overlap the evaluation sets
(HumanEval, GSM8K, MBPP, MT-Bench). ``stdlib_prompts`` builds them from the
docstrings of this Python's standard library: always present, code-flavoured
like our evaluation, and unrelated to any benchmark. ``--prompts FILE`` takes
your own (a .jsonl with a "prompt" field per line, or plain text, one per line).
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import warnings
from pathlib import Path
from typing import Iterator, Optional

from tqdm import tqdm

from .errors import DFlashError

STDLIB_MODULES = [
    "os", "os.path", "shutil", "pathlib", "json", "re", "math", "statistics", "random", "string",
    "textwrap", "itertools", "functools", "operator", "collections", "heapq", "bisect", "datetime",
    "calendar", "time", "csv", "sqlite3", "hashlib", "base64", "binascii", "struct", "zlib", "gzip",
    "zipfile", "tarfile", "fnmatch", "glob", "tempfile", "subprocess", "threading", "queue",
    "asyncio", "socket", "urllib.parse", "http.client", "email.utils", "html", "difflib",
    "unicodedata", "decimal", "fractions", "copy", "pprint", "enum", "dataclasses", "typing",
    "contextlib", "logging", "argparse", "shlex", "uuid", "secrets", "ipaddress", "array", "io",
]
TEMPLATES = [
    "Write a Python function that does the following: {doc}",
    "Implement `{name}` from scratch in Python. Its documentation says: \"{doc}\"",
    "Explain what `{qualname}` does in Python and give a short example.",
    "Write a small Python program that uses `{qualname}`. It should {lower_doc}",
    "How would I {lower_doc} in Python? Show code.",
    "Write unit tests (pytest) for a function that does this: {doc}",
]


def _first_sentence(doc: str) -> Optional[str]:
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    if not 20 <= len(line) <= 200 or line.startswith((">>>", "(", "[")):
        return None
    return line if line.endswith(".") else line + "."


def stdlib_prompts(seed: int = 0) -> list[str]:
    """Deterministic, de-duplicated prompts from standard-library docstrings."""
    prompts = []
    for module_name in STDLIB_MODULES:
        try:
            with warnings.catch_warnings():  # some modules warn about their own deprecation
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                doc = _first_sentence(inspect.getdoc(obj) or "")
            if doc is None:
                continue
            fields = {"doc": doc, "name": name, "qualname": f"{module_name}.{name}",
                      "lower_doc": doc[0].lower() + doc[1:]}
            prompts += [t.format(**fields) for t in TEMPLATES]
    prompts = sorted(set(prompts))
    random.Random(seed).shuffle(prompts)
    return prompts


def read_prompts(path: str) -> list[str]:
    file = Path(path)
    if not file.is_file():
        raise DFlashError(f"prompts file not found: {path}")
    lines = [line for line in file.read_text().splitlines() if line.strip()]
    if file.suffix != ".jsonl":
        return lines
    try:
        return [json.loads(line)["prompt"] for line in lines]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise DFlashError(f"{path}: every line must be a JSON object with a \"prompt\" field") from None


def encode_chat(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
    return tokenizer.encode(prompt)


SEQUENCES_FILE = "sequences.jsonl"


def read_sequences(data_dir: str | Path) -> list[dict]:
    """Records {"id", "tokens", "prompt_len"}: tokens = prompt + the target's response."""
    path = Path(data_dir) / SEQUENCES_FILE
    if not path.is_file():
        raise DFlashError(f"{data_dir} holds no {SEQUENCES_FILE}; create it with `mlx-dflash data`")
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut short by an interrupted run: everything before it is good
    return records


def _batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def build_dataset(model, tokenizer, prompts: list[str], out_dir: str | Path, max_tokens: int = 256,
                  batch_size: int = 64) -> Path:
    """Generate greedy responses for ``prompts`` (resumable: done ids are skipped)."""
    from mlx_lm.generate import batch_generate

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SEQUENCES_FILE
    done: set[int] = set()
    if path.is_file():  # resume: keep the complete records, drop a line cut short by an interruption
        records = read_sequences(out)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        done = {r["id"] for r in records}
    todo = [(i, p) for i, p in enumerate(prompts) if i not in done]
    with open(path, "a") as sink, tqdm(total=len(prompts), initial=len(prompts) - len(todo),
                                         desc="responses", unit="prompt") as bar:
        # chunks of 4 batches: continuous batching keeps `batch_size` sequences in flight, and
        # each chunk is written before the next starts (an interrupted run loses one chunk)
        for batch in _batches(todo, 4 * batch_size):
            encoded = [encode_chat(tokenizer, p) for _, p in batch]
            result = batch_generate(model, tokenizer, encoded, max_tokens=max_tokens, return_token_ids=True,
                                    completion_batch_size=batch_size, prefill_batch_size=batch_size)
            for (index, _), prompt_ids, response in zip(batch, encoded, result.token_ids):
                response = list(response)
                if len(response) < max_tokens and tokenizer.eos_token_id is not None:
                    response.append(tokenizer.eos_token_id)  # it stopped on EOS: the draft must learn to stop
                record = {"id": index, "prompt_len": len(prompt_ids), "tokens": prompt_ids + response}
                sink.write(json.dumps(record) + "\n")
            sink.flush()
            bar.update(len(batch))
    return out
