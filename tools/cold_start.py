"""What the first generations of a fresh process cost on a GPU, and which kernels they build.

    MLX_PTX_CACHE_DIR=$(mktemp -d) python tools/cold_start.py --method dflash --generations 2
    MLX_PTX_CACHE_DIR=$(mktemp -d) python tools/cold_start.py --method mlx-lm

MLX's CUDA backend compiles a kernel the first time it meets it and keeps it on disk
(``MLX_PTX_CACHE_DIR``, by default under the system's temporary folder): run each method in a
fresh process with an empty folder for its cold figure, again with the folder kept for the
"fresh process, warm disk" one. Scale mode's random target (``--shape``), whose greedy
continuation repeats the prompt's last token, so a replay at ``--replay-mean`` needs no
reference run first (a reference run would build the shared kernels for it). Prints one JSON
line per generation (after ``--warmup``'s seconds, with ``generate --warmup``'s warm-up): wall seconds, decode tokens/s, the cycles that stalled (over
``--stall-ms``) with their position and block size, and the kernel files the cache gained.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from mlx_dflash.generate import stream_generate
from mlx_dflash.proposer import DFlashProposer
from mlx_dflash.replay import ReplayProposer, geometric_schedule
from mlx_dflash.scale import null_tokenizer, random_draft, random_target
from mlx_dflash.warmup import warm_up


def kernel_cache() -> Path:
    folder = os.environ.get("MLX_PTX_CACHE_DIR")
    return Path(folder) if folder else Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def cached_kernels() -> set[str]:
    folder = kernel_cache()
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def run_mlx_lm(model, tokenizer, prompt: list[int], length: int) -> tuple[list[int], list[tuple]]:
    from mlx_lm.generate import stream_generate as mlx_lm_stream

    tokens, marks = [], []
    for response in mlx_lm_stream(model, tokenizer, mx.array(prompt), max_tokens=length):
        tokens.append(response.token)
        marks.append((time.perf_counter(), len(tokens), 1))
    return tokens, marks


def run_dflash(model, tokenizer, prompt: list[int], length: int, proposer) -> tuple:
    tokens, marks = [], []
    for response in stream_generate(model, tokenizer, prompt, proposer, max_tokens=length):
        tokens += response.tokens
        marks.append((time.perf_counter(), len(tokens), len(response.tokens)))
    return tokens, marks


def report(marks: list[tuple], tic: float, stall_ms: float) -> dict:
    first = marks[0][0]
    gaps = [(b[0] - a[0]) * 1000 for a, b in zip(marks, marks[1:])]
    typical = statistics.median(gaps) if gaps else 0.0
    stalls = [{"cycle": i + 1, "position": marks[i + 1][1], "ms": round(g, 1)}
              for i, g in enumerate(gaps) if g > stall_ms]
    decoded = marks[-1][1] - marks[0][1]
    return {"wall_s": round(marks[-1][0] - tic, 2), "first_token_s": round(first - tic, 2),
            "decode_tok_s": round(decoded / max(marks[-1][0] - first, 1e-9), 1), "median_cycle_ms": round(typical, 2),
            "stalled_ms": round(sum(s["ms"] - typical for s in stalls), 1), "stalls": stalls[:40]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=["dflash", "mlx-lm"], default="dflash")
    p.add_argument("--shape", default="qwen3.5-9b")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--replay-mean", type=float, default=6.5)
    p.add_argument("--generations", type=int, default=1)
    p.add_argument("--warmup", action="store_true", help="dflash: run the warm-up (warmup.py) before the first")
    p.add_argument("--stall-ms", type=float, default=100.0)
    args = p.parse_args()

    model, config = random_target(args.shape)
    tokenizer = null_tokenizer(config["vocab_size"])
    prompt = mx.random.randint(0, config["vocab_size"], (args.prompt_len,), key=mx.random.key(0)).tolist()
    reference = prompt + [prompt[-1]] * (args.length + 16)  # (the random target repeats its last token)
    draft = random_draft(config)
    warmed = {}
    if args.warmup and args.method == "dflash":
        before = cached_kernels()
        warmed = {"warmup_s": round(warm_up(model, DFlashProposer(draft)), 2),
                  "warmup_kernels_built": len(cached_kernels() - before)}
    for generation in range(args.generations):
        before = cached_kernels()
        tic = time.perf_counter()
        if args.method == "mlx-lm":
            tokens, marks = run_mlx_lm(model, tokenizer, prompt, args.length)
        else:
            replay = ReplayProposer(reference, draft.block_size, geometric_schedule(args.replay_mean, draft.block_size),
                                    config["vocab_size"], cost_of=DFlashProposer(draft))
            tokens, marks = run_dflash(model, tokenizer, prompt, args.length, replay)
        line = {"method": args.method, "shape": args.shape, "generation": generation + 1, **warmed,
                **report(marks, tic, args.stall_ms),
                "greedy_as_expected": tokens == reference[len(prompt): len(prompt) + len(tokens)],
                "kernels_built": len(cached_kernels() - before), "kernel_names": sorted(cached_kernels() - before)[:60]}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
