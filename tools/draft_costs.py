"""Drafts side by side on one target: decode speed, tokens per verify and ms per cycle.

    python tools/draft_costs.py [--model M] [--drafts D1 D2 ...] [--identity-v2] [--selector-off]
        [--convs-off] [--num-prompts 8] [--max-tokens 256]

HumanEval chat prompts, greedy, fixed full blocks; each draft runs every prompt once after a
warm-up of its own, the drafts alternating per prompt (a noisy machine then treats them alike).
The median speed-up is over the per-prompt ratios to the first draft. ``--identity-v2`` adds, for
each v1 draft, the DFlash2 draft that proposes exactly what it proposes (identity convolutions, a
zero successor codebook: ``draft.to_dflash2``, the start of ``train --arch dflash2 --init``), so
the two differ only in what a v2 cycle computes: the same texts at the same acceptance, and the
difference in ms per cycle is the v2 draft's own cost on this machine. ``--selector-off`` adds, for
each DFlash2 draft, a copy whose successor codebook is zero (its selector keeps the head's ranking,
its convolutions stay): what the selector adds to tokens per verify, and what it costs;
``--convs-off`` a copy without its convolutions (its selector stays): what they add. "Ops a
draft" counts the operations other than views in one greedy draft of a full block, as MLX's graph
holds them on the machine it runs on: on a GPU, where a small model's cycle is bound by launches,
each is a kernel (on the CPU MLX's fused norms and rotary embeddings count as their parts; compare
on one machine).
"""

import argparse
import re
import tempfile
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_dflash import generate, load, use_fast_blas
from mlx_dflash.bench import humaneval_prompts, side_by_side_cells
from mlx_dflash.draft import to_dflash2
from mlx_dflash.draft_io import dequantize_draft, is_quantized
from mlx_dflash.pair import load_pair_draft
from mlx_dflash.proposer import DFlashProposer
from mlx_dflash.target import Target, float_dtype, text_args

VIEWS = {"Broadcast", "Slice", "Squeeze", "Reshape", "ExpandDims", "Transpose", "Flatten", "Unflatten", "StopGradient"}


def ops_a_draft(model, draft) -> int:
    """Non-view operations in one greedy draft of a full block after a few context tokens."""
    proposer = DFlashProposer(draft)
    proposer.start(Target(model, draft.config.target_layer_ids))
    width = len(draft.config.target_layer_ids) * text_args(model).hidden_size
    proposer.add_context(mx.zeros((1, 8, width), float_dtype(model)))
    mx.eval(proposer.state)
    drafted = proposer.propose(mx.array([1], mx.uint32), draft.block_size - 1)
    with tempfile.TemporaryDirectory() as folder:
        mx.export_to_dot(f"{folder}/graph.dot", drafted)
        labels = re.findall(r'label ="(\w+)"', Path(f"{folder}/graph.dot").read_text())
    return sum(label not in VIEWS for label in labels)


def float_copy(draft, dtype):
    """A copy of a draft in float weights (``dtype`` where it is quantized), to change apart."""
    if is_quantized(draft):
        return dequantize_draft(draft, dtype)
    copy = type(draft)(draft.config)
    copy.load_weights(list(tree_flatten(draft.parameters())))
    return copy


def selector_off(draft, dtype):
    """A copy of a DFlash2 draft whose selector keeps the head's ranking (a zero successor codebook)."""
    copy = float_copy(draft, dtype)
    codebook = copy.candidate_selector.successor_codebook
    codebook.weight = mx.zeros_like(codebook.weight)
    mx.eval(copy.parameters())
    return copy


def convs_off(draft, dtype):
    """A copy of a DFlash2 draft without its convolutions (``conv_kernel_size`` 0: as if they were
    the identity, in fewer operations); its selector stays."""
    copy = float_copy(draft, dtype)
    bare = type(copy)(replace(copy.config, dflash2=replace(copy.config.dflash2, conv_kernel_size=0)))
    bare.load_weights([(name, value) for name, value in tree_flatten(copy.parameters()) if "_conv." not in name])
    mx.eval(bare.parameters())
    return bare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--drafts", nargs="+", default=[None], help="default: the draft shipped for the model")
    parser.add_argument("--identity-v2", action="store_true", help="add each v1 draft's identity DFlash2 draft")
    parser.add_argument("--selector-off", action="store_true", help="add each DFlash2 draft with its selector off")
    parser.add_argument("--convs-off", action="store_true", help="add each DFlash2 draft without its convolutions")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    use_fast_blas()
    model, tokenizer, first = load(args.model, args.drafts[0])
    drafts = [(args.drafts[0] or "shipped", first)]
    drafts += [(path, load_pair_draft(path, model)) for path in args.drafts[1:]]
    if args.identity_v2:
        for i, (name, draft) in reversed(list(enumerate(drafts))):
            if draft.config.dflash2 is None:
                # (the v2 copy needs float weights; a quantized v1 is compared as its float copy too)
                v1 = dequantize_draft(draft, float_dtype(model)) if is_quantized(draft) else draft
                drafts[i: i + 1] = [(name, v1), (f"{name} as identity DFlash2", to_dflash2(v1))]

    changes = [(change, part) for wanted, change, part in [(args.selector_off, selector_off, "selector"),
                                                           (args.convs_off, convs_off, "convolutions")] if wanted]
    for i, (name, draft) in reversed(list(enumerate(drafts))):
        if draft.config.dflash2 is not None:  # (each DFlash2 draft followed by its copies)
            drafts[i + 1: i + 1] = [(f"{name} with its {part} off", change(draft, float_dtype(model)))
                                    for change, part in changes]

    prompts = humaneval_prompts()[: args.num_prompts]
    for _, draft in drafts:
        generate(model, tokenizer, prompts[0], draft, max_tokens=32, chat=True, trees=False, warmup=True)
    results = [[] for _ in drafts]
    for prompt in prompts:
        for (_, draft), runs in zip(drafts, results):
            runs.append(generate(model, tokenizer, prompt, draft, max_tokens=args.max_tokens, chat=True, trees=False))
    baseline = results[0]
    print("| draft | decode tok/s | median speed-up over the first | tokens per verify | ms a cycle | ops a draft |")
    print("|---|---|---|---|---|---|")
    for (name, draft), runs in zip(drafts, results):
        print(f"| {name} | {side_by_side_cells(runs, baseline)} | {ops_a_draft(model, draft)} |")
    same = all(r.tokens == b.tokens for runs in results for r, b in zip(runs, baseline))
    print(f"({len(prompts)} prompts x {args.max_tokens} tokens; every draft the same texts: {same})")


if __name__ == "__main__":
    main()
