"""Scale mode of the benchmark: real model SHAPES with random weights, no checkpoints.

The target is a random-weight mlx-lm model shaped like a published one; the
draft is a random DFlash draft of the published shape that runs every cycle
(so its cost is real) while a replay supplies the proposals, corrupted so that
acceptance lengths follow a chosen distribution. Results are engine cost, to
be labelled "replay", never measured acceptance.
"""

from __future__ import annotations

import importlib
import time
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .distributed import shard
from .draft import DFlashDraft, create_random_draft
from .engine import prefill
from .proposer import DFlashProposer
from .errors import DFlashError
from .policy import TREE_BUDGETS
from .target import Target
from .tree import build_tree

SHAPES = {
    "qwen3-4b": {"model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36, "intermediate_size": 9728,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True},
    "qwen3-8b": {"model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36, "intermediate_size": 12288,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
    "qwen3-14b": {"model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 40, "intermediate_size": 17408,
                  "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
    # 128 experts, 8 active a token: ~3B of its 30B weights read a step
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "norm_topk_prob": True, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "head_dim": 128, "tie_word_embeddings": False},
    # SmolLM2-135M's depth at negligible width: a step is all host work
    "deep-thin": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 30, "intermediate_size": 128,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
                  "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    "tiny": {"model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True,
             "vocab_size": 4096},  # (a test shape: a real vocabulary's head would be most of its time)
}
# Qwen3.5: 3 Gated DeltaNet layers per full-attention layer (head_dim 256), 248k vocabulary.
_QWEN3_5 = {"model_type": "qwen3_5", "vocab_size": 248320, "head_dim": 256, "num_attention_heads": 16,
            "num_key_value_heads": 4, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "rope_parameters": {"type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}}
SHAPES.update({
    "qwen3.5-4b": {**_QWEN3_5, "hidden_size": 2560, "num_hidden_layers": 32, "intermediate_size": 9216,
                   "tie_word_embeddings": True},
    "qwen3.5-9b": {**_QWEN3_5, "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 12288,
                   "tie_word_embeddings": False},
    "qwen3.5-27b": {**_QWEN3_5, "hidden_size": 5120, "num_hidden_layers": 64, "intermediate_size": 17408,
                    "num_attention_heads": 24, "linear_num_value_heads": 48, "tie_word_embeddings": False},
    "tiny-hybrid": {**_QWEN3_5, "vocab_size": 4096, "hidden_size": 128, "num_hidden_layers": 4,
                    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                    "linear_value_head_dim": 32, "tie_word_embeddings": True},
})
QUANTIZED_ONLY = {"qwen3.5-27b"}  # too big to be worth a bf16 run next to the others
EMBEDDING_SCALE = 64.0  # steady_greedy: the token's own embedding outweighs every layer's output
COMMON = {"rms_norm_eps": 1e-6, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1_000_000.0}


def random_target(shape: str, quant: Optional[int] = None, vocab_size: Optional[int] = None,
                  group: Optional[mx.distributed.Group] = None):
    """(model, config) of ``shape`` in bfloat16 (or quantized to ``quant`` bits), random weights;
    with a ``group``, sharded over its processes (``distributed.shard``)."""
    if shape not in SHAPES:
        raise DFlashError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if shape in QUANTIZED_ONLY and not quant:
        raise DFlashError(f"{shape} runs quantized only: add --quant 4 or --quant 8")
    config = {**COMMON, **SHAPES[shape]}
    if vocab_size:
        config["vocab_size"] = vocab_size
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    if group is not None:
        mx.random.seed(0)  # (every process draws the same weights, then keeps its slice of them)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    steady_greedy(model)
    if group is not None:
        shard(model, config["model_type"], group)
    if quant:
        nn.quantize(model, group_size=64, bits=quant)
    mx.eval(model.parameters())
    return model, config


def steady_greedy(model, embedding_scale: float = EMBEDDING_SCALE) -> None:
    """Make the random model's greedy next token its current token, by a wide margin.

    Plain random weights give near-flat logits (top two often tied in bfloat16), so a 16-token
    verify and single steps, whose rounding differs, pick different tokens and a replay of the
    greedy continuation stops matching (the replay's planted acceptance is lost). Scaling the
    embeddings up makes each position's residual stream mostly its own
    token's embedding, and a head equal to the embeddings then scores that token far above any
    other. Costs are unchanged: same shapes, same operations."""
    lm = getattr(model, "language_model", model)
    embed = lm.model.embed_tokens
    embed.weight = embed.weight * embedding_scale
    if hasattr(lm, "lm_head"):
        lm.lm_head.weight = embed.weight


def null_tokenizer(vocab_size: int):
    """A word-level tokenizer with one token per id ('▁t0', '▁t1', ...): enough for the engine.

    Streamed through mlx-lm's SentencePiece detokenizer, whose cost per token is constant, as
    with real models' tokenizers. (mlx-lm's default one decodes the whole line again for every
    token, and a line never ends here: O(T^2), paid by mlx-lm's stream_generate every token and
    by DFlash once a cycle, which would inflate scale-mode speed-ups.)"""
    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer, TokenizerWrapper
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"\u2581t{i}": i for i in range(vocab_size)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="\u2581t0")))
    return TokenizerWrapper(fast, detokenizer_class=SPMStreamingDetokenizer, eos_token_ids=[])


def random_draft(config: dict, layers: int = 5, block_size: int = 16, vocab: Optional[int] = None) -> DFlashDraft:
    """A random bf16 draft; ``vocab``: it drafts from the first ``vocab`` token ids (the cost of
    a draft vocabulary of that size: with random weights, which ids does not matter)."""
    draft = create_random_draft(config, num_layers=layers, block_size=block_size, mask_token_id=config["vocab_size"] - 1)
    draft.set_dtype(mx.bfloat16)
    if vocab:
        draft.config.draft_vocab = list(range(min(vocab, config["vocab_size"])))
    return draft


def milliseconds_per_call(fn: Callable[[], object], iters: int) -> float:
    """Mean wall milliseconds of ``fn()`` over ``iters`` calls, after one call not timed (kernel
    builds, graphs, allocator). ``fn`` must evaluate what it builds (``mx.eval``)."""
    fn()
    tic = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - tic) * 1000 / iters


def cycle_costs(model, draft: DFlashDraft, context_len: int, block_size: int, iters: int = 20,
                tree_budgets: Sequence[int] = TREE_BUDGETS) -> dict:
    """Milliseconds per draft pass, verify pass, rollback of half a block and single-token
    decode at ``context_len``, a tree's verify and roll back (a path of half a block kept) per
    budget, and the host's share of a cycle. Rollback is timed as (verify +
    roll back half) - (verify + roll back all): the full rollback is free for every cache, the
    half one is what a hybrid's recurrent layers add (the state after a prefix, delta_rule.py).
    Host: building one cycle's graphs (draft, then verify) in Python before anything runs;
    where it is not hidden behind the device's work (small models on GPUs) it adds to every
    cycle."""
    target = Target(model, draft.config.target_layer_ids)
    proposer = DFlashProposer(draft)
    proposer.start(target)
    cache = target.make_cache()
    prompt = mx.random.randint(0, target.vocab_size, (context_len,)).astype(mx.uint32)
    prefill(target, proposer, prompt, cache, target.options.prefill_step)
    mx.eval([c.state for c in cache], proposer.state)
    first = mx.array([1], dtype=mx.uint32)
    block = mx.random.randint(0, target.vocab_size, (1, block_size)).astype(mx.uint32)

    def draft_pass():
        mx.eval(proposer.propose(first, block_size - 1))

    def verify_then_rollback(keep: int):
        def run():
            logits, feats = target(block, cache)
            mx.eval(mx.argmax(logits, axis=-1), feats)
            target.rollback(cache, block_size - keep)
            mx.eval([c.state for c in cache])  # (keeping tokens grows the context by <= 21 * keep)
        return run

    def decode_one():
        logits, _ = target(first[None], cache)
        mx.eval(mx.argmax(logits, axis=-1))
        target.rollback(cache, 1)

    def host_build() -> float:
        tic = time.perf_counter()
        drafted = proposer.propose(first, block_size - 1).astype(mx.uint32)
        logits, feats = target(mx.concatenate([first, drafted])[None], cache)
        tokens = mx.argmax(logits, axis=-1)
        seconds = time.perf_counter() - tic
        mx.eval(tokens, feats)
        target.rollback(cache, block_size)
        mx.eval([c.state for c in cache])
        return seconds

    def tree_verify(budget: int) -> Callable[[], None]:
        rng = np.random.default_rng(budget)
        logprobs = -np.sort(rng.exponential(1.0, (block_size - 1, budget)), axis=1)
        tree = build_tree(1, logprobs, rng.integers(0, target.vocab_size, logprobs.shape), budget)
        path = [0]
        for node in range(1, tree.size):  # (the first node of each depth, down to half a block)
            if tree.parents[node] == path[-1] and len(path) < block_size // 2:
                path.append(node)

        def run():
            logits, feats = target.verify_tree(tree, cache)
            mx.eval(mx.argmax(logits, axis=-1), feats)
            target.keep_path(cache, path, tree.size)
            target.rollback(cache, len(path))  # (back to the context: the next call sees the same one)
            mx.eval([c.state for c in cache])
        return run

    host_build()  # warm-up
    host_ms = sum(host_build() for _ in range(iters)) * 1000 / iters
    verify_ms = milliseconds_per_call(verify_then_rollback(0), iters)
    trees = {budget: milliseconds_per_call(tree_verify(budget), iters) for budget in tree_budgets
             if target.verifies_trees}
    return {
        "context_len": context_len,
        "draft_ms": milliseconds_per_call(draft_pass, iters),
        "verify_plus_rollback_ms": verify_ms,
        "rollback_ms": max(milliseconds_per_call(verify_then_rollback(block_size // 2), iters) - verify_ms, 0.0),
        "decode_one_token_ms": milliseconds_per_call(decode_one, iters),
        "host_ms": host_ms,
        **{f"tree{budget}_verify_ms": ms for budget, ms in trees.items()},
    }
