"""``mlx-dflash data``: a self-distillation set, prompts -> the target's OWN responses.

DFlash drafts learn to predict what the target says, so the training text is
the target's greedy output to a prompt set, stored as token ids with the prompt
length (the loss covers response tokens only).

Prompts must be available offline and must not overlap the evaluation sets
(HumanEval, GSM8K, MBPP, MT-Bench). ``stdlib_prompts`` builds them from the
docstrings of this Python's standard library (code questions, and requests to
complete a stdlib function from its header, docstring and doctest examples): always present,
code-flavoured like our evaluation, and unrelated to any benchmark. ``package_prompts`` does
the same for installed packages (``--prompt-packages numpy scipy``: more, and more varied,
code). ``--prompts FILE`` takes your own (a .jsonl with a "prompt" field per line, or plain
text, one per line).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import random
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from .errors import DFlashError

# Modules whose import has side effects (a browser, a poem, a GUI) or that are platform-only.
SKIPPED_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3",
                   "pydoc_data", "ensurepip", "venv", "msilib", "winreg", "winsound", "nt", "msvcrt"}
TEMPLATES = [
    "Write a Python function that does the following: {doc}",
    "Implement `{name}` from scratch in Python. Its documentation says: \"{doc}\"",
    "Explain what `{qualname}` does in Python and give a short example.",
    "Write a small Python program that uses `{qualname}`. It should {lower_doc}",
    "How would I {lower_doc} in Python? Show code.",
    "Write unit tests (pytest) for a function that does this: {doc}",
    "What are common mistakes when using `{qualname}`? Show a correct usage.",
    "Rewrite this description as a Python docstring and write the function body: {doc}",
    "Write a command-line script around `{qualname}` with argparse.",
    "Compare `{qualname}` with a hand-written alternative. When is each better?",
    "I need to {lower_doc} Write a well-commented Python solution.",
    "Write a JavaScript function equivalent to Python's `{qualname}`: {doc}",
]
# Code-completion requests: a function header and its docstring, to be written out whole.
COMPLETION_TEMPLATES = [
    "Complete this Python function. Return the full implementation in one code block.\n\n```python\n{header}\n```",
    "Finish the implementation below.\n\n```python\n{header}\n```",
]


def _first_sentence(doc: str) -> Optional[str]:
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    if not 20 <= len(line) <= 200 or line.startswith((">>>", "(", "[")):
        return None
    return line if line.endswith(".") else line + "."


MAX_HEADER_DOC = 800  # characters of docstring in a completion prompt


def _doctest_part(paragraph: str) -> str:
    """A paragraph from its first ``>>>`` line on (drops a heading such as numpy's "Examples"),
    dedented (Google-style docstrings indent their examples under "Example:")."""
    lines = paragraph.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith(">>>")), None)
    return "" if start is None else textwrap.dedent("\n".join(lines[start:])).strip()


def _header_docstring(doc: str) -> str:
    """The docstring's first two paragraphs, then its first doctest examples when they fit:
    a description and examples, the shape of the code-completion requests users make."""
    paragraphs = doc.split("\n\n")
    description = "\n\n".join(paragraphs[:2]).strip()
    examples = [e for e in map(_doctest_part, paragraphs[2:]) if e][:2]
    with_examples = "\n\n".join([description, *examples])
    return with_examples if len(with_examples) <= MAX_HEADER_DOC else description


def _function_header(name: str, obj) -> Optional[str]:
    """``def name(signature):`` with its docstring's description and examples, or None when the
    signature is unknown (many builtins) or does not print as Python (``<object at 0x...>``)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = [p for p in signature.parameters.values() if p.name not in ("self", "cls")]
    doc = _header_docstring(inspect.getdoc(obj) or "").replace('"""', "'''")
    if not 20 <= len(doc) <= MAX_HEADER_DOC:
        return None
    body = "\n".join("    " + line if line.strip() else "" for line in doc.splitlines())
    try:
        header = f'def {name}{signature.replace(parameters=params)}:\n    """\n{body}\n    """'
    except Exception:  # a default whose repr raises (a lazy object, e.g. Django's translations)
        return None
    try:
        function = ast.parse(header).body[0]
    except SyntaxError:
        return None
    # a default that prints as a call (cgi's ``environ=environ({...})``) spells out an object of
    # this process, e.g. its environment variables: not for a training set
    defaults = function.args.defaults + [d for d in function.args.kw_defaults if d is not None]
    if any(isinstance(node, ast.Call) for d in defaults for node in ast.walk(d)):
        return None
    return header


def _is_function_or_class(obj) -> bool:
    try:
        return inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)
    except Exception:  # a lazy object that raises when inspected (Django's unconfigured settings)
        return False


def _documented_objects(module_name: str, module) -> Iterator[tuple[str, str, str, object]]:
    """(name, qualname, first docstring sentence, object) of a module's own public functions,
    classes and class methods (re-exports from other modules are skipped: they repeat)."""
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not _is_function_or_class(obj):
            continue
        if getattr(obj, "__module__", module_name) != module_name:
            continue
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            continue  # "Common base class for all non-exit exceptions." makes poor prompts
        members = [(name, f"{module_name}.{name}", obj)]
        if inspect.isclass(obj):
            members += [(m, f"{module_name}.{name}.{m}", v) for m, v in sorted(vars(obj).items())
                        if not m.startswith("_") and callable(v)]
        for short, qualname, member in members:
            doc = _first_sentence(inspect.getdoc(member) or "")
            if doc is not None:
                yield short, qualname, doc, member


def _import_quietly(module_name: str):
    """The module, or None when it cannot be imported here (not built on this platform, a
    missing optional dependency); its import-time prints are swallowed."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return importlib.import_module(module_name)
    except (Exception, SystemExit):  # SystemExit: a script-like module that exits when imported
        return None


def _package_modules(package: str) -> list[str]:
    """An installed package and its public submodules (none under a private or test folder)."""
    module = _import_quietly(package)
    if module is None:
        raise DFlashError(f"cannot import the package {package!r} for prompts (is it installed?)")
    names = [package]
    if hasattr(module, "__path__"):
        for info in pkgutil.walk_packages(module.__path__, prefix=package + ".", onerror=lambda name: None):
            parts = info.name.split(".")[1:]
            if not any(p.startswith("_") or p in ("test", "tests", "testing", "conftest") for p in parts):
                names.append(info.name)
    return sorted(names)


def module_prompts(module_names: list[str], seed: int = 0, completion_only: bool = False) -> list[str]:
    """Deterministic, de-duplicated prompts from these modules' docstrings: code questions in
    ``TEMPLATES`` about every documented public function, class and method (unless
    ``completion_only``), and requests to complete each function from its header and docstring
    (``COMPLETION_TEMPLATES``)."""
    prompts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some modules and docstrings warn about their own deprecation
        for module_name in module_names:
            module = _import_quietly(module_name)
            if module is None:
                continue
            for name, qualname, doc, obj in _documented_objects(module_name, module):
                fields = {"doc": doc, "name": name, "qualname": qualname, "lower_doc": doc[0].lower() + doc[1:]}
                if not completion_only:
                    prompts += [t.format(**fields) for t in TEMPLATES]
                header = None if inspect.isclass(obj) else _function_header(name, obj)
                if header is not None:
                    prompts += [t.format(header=header) for t in COMPLETION_TEMPLATES]
    prompts = sorted(set(prompts))
    random.Random(seed).shuffle(prompts)
    return prompts


def stdlib_prompts(seed: int = 0, completion_only: bool = False) -> list[str]:
    """Prompts from this Python's standard library (always present, offline)."""
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIPPED_MODULES)
    return module_prompts(names, seed, completion_only)


def package_prompts(packages: list[str], seed: int = 0, completion_only: bool = False) -> list[str]:
    """Prompts from installed packages (e.g. numpy, scipy): more code, beyond the stdlib."""
    return module_prompts([name for package in packages for name in _package_modules(package)], seed,
                          completion_only)


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


def _batch_cache(model, left_padding: list[int]) -> list:
    """The batched form of each of the model's caches (left-padded prompts)."""
    from mlx_lm.models import cache as cache_lib

    batched = []
    for layer_cache in cache_lib.make_prompt_cache(model):
        if type(layer_cache) is cache_lib.KVCache:
            batched.append(cache_lib.BatchKVCache(left_padding))
        elif type(layer_cache) is cache_lib.RotatingKVCache:
            batched.append(cache_lib.BatchRotatingKVCache(layer_cache.max_size, left_padding))
        elif type(layer_cache) is cache_lib.ArraysCache:
            batched.append(cache_lib.ArraysCache(len(layer_cache.cache), left_padding))
        else:
            raise DFlashError(f"batched generation does not support {type(layer_cache).__name__}")
    return batched


def greedy_batch(model, prompts: list[list[int]], max_tokens: int, eos_ids: set[int],
                 prefill_chunk: int = 512) -> list[list[int]]:
    """Greedy responses for one batch of prompts, each cut after its first EOS (kept).

    A static batch: every row steps until all have stopped, with one step queued ahead
    of the host (as in mlx-lm's loop). mlx-lm's ``batch_generate`` admits and retires
    sequences continuously, which copies the whole batch's caches each time one finishes
    (several times slower here, docs/performance.md). Rows that stopped early cost a little
    wasted compute instead.
    """
    longest = max(len(p) for p in prompts)
    padding = [longest - len(p) for p in prompts]
    cache = _batch_cache(model, padding)
    tokens = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)])
    # All but the last position fill the caches (their logits are never evaluated); the last one
    # alone gives the first token, so no (rows x chunk x vocabulary) logits are ever held.
    for start in range(0, longest - 1, prefill_chunk):
        model(tokens[:, start : min(start + prefill_chunk, longest - 1)], cache=cache)
    next_tokens = mx.argmax(model(tokens[:, -1:], cache=cache)[:, -1], axis=-1)
    mx.async_eval(next_tokens)
    steps, stopped, eos = [], np.zeros(len(prompts), bool), np.array(sorted(eos_ids))
    for step in range(max_tokens):
        current = next_tokens
        if step + 1 < max_tokens:
            next_tokens = mx.argmax(model(current[:, None], cache=cache)[:, -1], axis=-1)
            mx.async_eval(next_tokens)
        steps.append(np.array(current))
        stopped |= np.isin(steps[-1], eos)
        if stopped.all():
            break
    responses = np.stack(steps, axis=1).tolist()
    for row in responses:
        end = next((i for i, t in enumerate(row) if t in eos_ids), len(row) - 1)
        del row[end + 1 :]
    return responses


def answer_order(todo: list[tuple[int, list[int]]], batch_size: int,
                 batches_per_window: int = 16) -> list[tuple[int, list[int]]]:
    """The (id, prompt ids) pairs in the order they are answered: windows of ``batches_per_window``
    batches taken in the prompts' order, each sorted by length. A batch's rows then have similar
    lengths (little padding), and a run stopped early holds prompts of every length, not only the
    shortest (the long code-completion prompts among them)."""
    window = batch_size * batches_per_window
    return [item for start in range(0, len(todo), window)
            for item in sorted(todo[start : start + window], key=lambda item: len(item[1]))]


def build_dataset(model, tokenizer, prompts: list[str], out_dir: str | Path, max_tokens: int = 256,
                  batch_size: int = 64) -> Path:
    """Generate greedy responses for ``prompts`` (resumable: done ids are skipped)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / SEQUENCES_FILE
    done: set[int] = set()
    if path.is_file():  # resume: keep the complete records, drop a line cut short by an interruption
        records = read_sequences(out)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        done = {r["id"] for r in records}
    todo = answer_order([(i, encode_chat(tokenizer, p)) for i, p in enumerate(prompts) if i not in done], batch_size)
    eos_ids = set(tokenizer.eos_token_ids)
    written = 0  # response tokens written by this run
    with open(path, "a") as sink, tqdm(total=len(prompts), initial=len(prompts) - len(todo),
                                         desc="responses", unit="prompt") as bar:
        for batch in _batches(todo, batch_size):  # each batch is written before the next starts
            responses = greedy_batch(model, [ids for _, ids in batch], max_tokens, eos_ids)
            for (index, prompt_ids), response in zip(batch, responses):
                sink.write(json.dumps({"id": index, "prompt_len": len(prompt_ids), "tokens": prompt_ids + response}) + "\n")
            sink.flush()
            written += sum(len(r) for r in responses)
            bar.update(len(batch))
            bar.set_postfix(tokens=written)
    return out
