"""Host and device time of each piece of a cycle, one piece at a time, with the kernels it launches.

    python tools/launch_costs.py [--model M] [--draft D] [--context 300] [--iters 30] [--pack off]
    python tools/launch_costs.py --shape qwen3.5-9b   # scale mode's random target and 5-layer draft

For each piece (mlx-lm's plain step; the tapped target's plain step and 16-token verify with the
engine's cache, its count on the device as in queued cycles, the verify eager and compiled
(``EngineOptions.compile_blocks``; packed and row-by-row projections there unless ``--pack off`` or
``--rowwise off``); the draft's context update and pass, eager and compiled
(``EngineOptions.compile_draft``); a tree of ``--tree-budget`` nodes built on the device from the
compiled draft's logits, and its compiled verify with the walk, the path's move and the roll back
(``tree.device_tree``, ``EngineOptions.device_trees``)), times building the graph, ``mx.async_eval`` with the device idle (the host
launching kernels) and the wait that follows (device work not hidden by the launch), median of
``--iters``; and counts the graph's primitives by kind (``mx.export_to_dot``; views such as
transposes and broadcasts launch nothing). Where launches dominate, a cycle costs what its
kernel count costs; where the wait does, the device is the bottleneck. "queued" runs the piece
``--iters`` times back to back without waiting (as queued cycles run): per piece, the larger of
the host's and the device's time; above build + async_eval, the device is the bottleneck.
"""

import argparse
import re
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_dflash import rollback, use_fast_blas
from mlx_dflash.draft_io import load_draft
from mlx_dflash.models import DEFAULT_MODEL, shipped_draft
from mlx_dflash.options import EngineOptions
from mlx_dflash.proposer import DFlashProposer
from mlx_dflash.sampling import matching_prefix
from mlx_dflash.scale import random_draft, random_target
from mlx_dflash.target import Target, float_dtype, load_target
from mlx_dflash.tree import device_tree

VIEWS = {"Broadcast", "Transpose", "ExpandDims", "Squeeze", "Slice", "Flatten", "Unflatten", "AsStrided"}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=DEFAULT_MODEL)
parser.add_argument("--draft", default=None)
parser.add_argument("--shape", default=None, help="a random target of this shape (scale.py) and a random draft")
parser.add_argument("--context", type=int, default=300)
parser.add_argument("--iters", type=int, default=30)
parser.add_argument("--tree-budget", type=int, default=64, help="the device-built tree's nodes (0: no tree pieces)")
parser.add_argument("--pack", choices=["on", "off"], default="on",
                    help="packed projections in the compiled verify (projections.py)")
parser.add_argument("--rowwise", choices=["on", "off", "auto"], default="auto",
                    help="plain projections row by row in the compiled verify (projections.py; auto: the "
                         "engine's rule, GPUs and models up to ROWWISE_MAX_BYTES)")
args = parser.parse_args()
use_fast_blas()
# the GPU's reads, also when run on the CPU; eager blocks and draft passes, except in the compiled pieces
OPTIONS = EngineOptions(pad_reads=True, compile_blocks=False, compile_draft=False, pack_projections=args.pack == "on",
                        rowwise_products={"on": True, "off": False, "auto": None}[args.rowwise])
COMPILED = EngineOptions(**{**vars(OPTIONS), "compile_blocks": True, "compile_draft": True})
if args.shape:
    model, config = random_target(args.shape)
    draft = random_draft(config)
else:
    model, tokenizer = load_target(args.model)
    draft = load_draft(args.draft or shipped_draft(args.model), dtype=float_dtype(model))
vocab = draft.config.vocab_size
prompt = mx.random.randint(0, vocab, (args.context,)).astype(mx.uint32)
block = mx.random.randint(0, vocab, (16,)).astype(mx.uint32)

target = Target(model, draft.config.target_layer_ids, OPTIONS)
compiled_target = Target(model, draft.config.target_layer_ids, COMPILED)  # (same taps, same cache types)
proposer, compiled_proposer = DFlashProposer(draft), DFlashProposer(draft)
cache = target.make_cache()
proposer.start(target), compiled_proposer.start(compiled_target)
_, features = target(prompt[None], cache)
proposer.add_context(features), compiled_proposer.add_context(features)
mx.eval(proposer.propose(block[:1], 15), compiled_proposer.propose(block[:1], 15), [c.state for c in cache])
# as in queued cycles: the counts on the device
for layer_cache in cache:
    if isinstance(layer_cache, rollback.DeviceKVCache):
        layer_cache.drop(mx.array(0))
mx.eval([c.offset for c in cache if hasattr(c, "offset")])
plain_cache = make_prompt_cache(model)
mx.eval(model(prompt[None], cache=plain_cache), [c.state for c in plain_cache])
features16 = mx.random.normal((1, 16, features.shape[-1])).astype(features.dtype)
mx.eval(features16)


def mlx_lm_step():
    out = model(block[None, :1], cache=plain_cache)
    for c in plain_cache:
        if c.is_trimmable():  # (a recurrent layer's state just moves on: the cost is the same)
            c.trim(1)
    return [mx.argmax(out[0, -1])]


def target_step():
    logits, feats = target(block[None, :1], cache)
    if not target.recurrent_ids:  # (one token: a recurrent layer has nothing to roll back but all)
        target.rollback(cache, mx.array(1))
    target.settle(cache, args.context)
    return [mx.argmax(logits[0, -1]), feats]


def target_verify(target=target):
    logits, feats = target(block[None], cache)
    tokens = mx.argmax(logits[0], axis=-1)
    accepted = matching_prefix(block[1:], tokens)
    # a device count: all 16 (a recurrent layer keeps at least one: 15, the context grows a token a call)
    target.rollback(cache, (15 if target.recurrent_ids else 16) - accepted[0] + accepted[0])
    target.settle(cache, args.context)
    return [tokens, accepted, feats]


def draft_context():
    proposer.add_context(features16, mx.array(5))
    out = [c.keys for c in proposer.cache] + [c.values for c in proposer.cache]
    proposer.settle(args.context)
    return out


def draft_pass(proposer=proposer):
    return [proposer.propose(block[:1], 15)]


def target_verify_compiled():
    return target_verify(compiled_target)


def draft_pass_compiled():
    return draft_pass(compiled_proposer)


def build_tree():
    logits, columns = compiled_proposer.candidate_logits(block[:1], 15)
    return device_tree(block[:1], logits, args.tree_budget, columns)


def tree_build():
    tree = build_tree()
    return [tree.tokens, tree.depths, tree.ancestors, tree.parents]


TREE = build_tree() if args.tree_budget else None


def tree_verify():
    logits, feats = compiled_target.verify_device_tree(TREE, cache)
    choices = mx.argmax(logits[0], axis=-1)
    order, accepted = TREE.walk(choices)
    tokens, feats = choices[order], feats[:, order]
    compiled_target.move_path(cache, order, 16)
    # a cycle rolls back the nodes off the path (a count on the device); the path's nodes go too,
    # so that every iteration starts from the same --context
    off_path = TREE.size - accepted[0]
    compiled_target.rollback(cache, off_path + accepted[0])
    compiled_target.settle(cache, args.context)
    return [tokens, accepted, feats]


def op_counts(outputs) -> Counter:
    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(dot), *outputs)
        return Counter(re.findall(r'label ="([^"]+)"', dot.read_text()))


def measure(name, piece):
    build, launch, wait = [], [], []
    for i in range(args.iters + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        outputs = piece()
        t1 = time.perf_counter()
        if i == 0:
            counts = op_counts(outputs)
        mx.async_eval(*outputs)
        t2 = time.perf_counter()
        mx.eval(*outputs)
        mx.synchronize()
        t3 = time.perf_counter()
        if i >= 3:
            build.append(t1 - t0), launch.append(t2 - t1), wait.append(t3 - t2)
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):  # back to back, no waits: each piece costs max(host, device)
        mx.async_eval(*piece())
    mx.synchronize()
    queued = (time.perf_counter() - t0) / args.iters
    kernels = sum(n for op, n in counts.items() if op not in VIEWS)
    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    print(f"{name:16s} build {ms(build):6.2f} ms | async_eval {ms(launch):6.2f} ms | wait {ms(wait):6.2f} ms "
          f"| queued {1000 * queued:6.2f} ms each | {kernels} primitives (+{sum(counts.values()) - kernels} views)",
          flush=True)
    top = ", ".join(f"{op} {n}" for op, n in counts.most_common() if op not in VIEWS)
    print(f"{'':16s} {top}", flush=True)


print(f"compiled verify's tokens equal eager ones: {mx.array_equal(target_verify_compiled()[0], target_verify()[0])}")
print(f"compiled draft's tokens equal eager ones: {mx.array_equal(draft_pass_compiled()[0], draft_pass()[0])}")
print(f"device {mx.default_device()}, context {args.context}, MLX {mx.__version__}, in the compiled verify "
      f"packed projections {args.pack}, row by row {args.rowwise}", flush=True)
for name, piece in [("mlx-lm step", mlx_lm_step), ("target step", target_step), ("target verify16", target_verify),
                    ("verify compiled", target_verify_compiled), ("draft context", draft_context),
                    ("draft pass", draft_pass), ("draft compiled", draft_pass_compiled)]:
    measure(name, piece)
if TREE is not None:
    mx.eval(TREE.tokens, TREE.depths, TREE.ancestors, TREE.parents)
    measure(f"tree{args.tree_budget} build", tree_build)
    measure(f"tree{args.tree_budget} verify", tree_verify)
