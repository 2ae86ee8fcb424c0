"""Generation for users: prompts in, text out. Turns the engine's committed tokens into
streamed text, with EOS and stop strings, the model's context bound, and statistics."""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field
from numbers import Integral
from typing import Iterator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from .draft import DFlashDraft
from .distributed import check_agreement
from .engine import ProgressCallback, decode_cycles
from .errors import DFlashError
from .options import DEFAULT_OPTIONS, EngineOptions
from .policy import BlockPolicy, check_block_size, check_tree_budget, fixed_tree_budget, tree_budgets
from .prefix_cache import PrefixCache
from .proposer import DFlashProposer, Proposer
from .sampling import SamplingParams
from .target import Target, check_compatible, context_length
from .warmup import warm_up

CONTINUATION_TOKENS = 4  # prompt tokens a continuation's detokenizer is primed with


@dataclass
class StreamResponse:
    """One streamed piece of output, in the spirit of mlx-lm's GenerationResponse."""

    text: str
    tokens: list[int]
    acceptance_length: Optional[int]
    cycle: int
    prompt_tokens: int
    prefill_seconds: float
    generation_tokens: int
    decode_tokens_per_sec: float
    finish_reason: Optional[str] = None
    reused_prompt_tokens: int = 0  # prompt tokens restored from a prefix cache, not prefilled
    verifies: int = 1  # the target verifies that committed its ``acceptance_length`` tokens


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_tokens_per_sec: float
    cycles: int
    acceptance_lengths: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    reused_prompt_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


def _find_stop(text: str, stops: Sequence[str], search_from: int) -> Optional[int]:
    hits = [i for i in (text.find(s, search_from) for s in stops) if i >= 0]
    return min(hits) if hits else None


def make_proposer(model: nn.Module, draft: Union[DFlashDraft, Proposer],
                  options: EngineOptions = DEFAULT_OPTIONS) -> tuple[Target, Proposer]:
    if isinstance(draft, DFlashDraft):
        check_compatible(draft, model)
        draft = DFlashProposer(draft)
    return Target(model, draft.layer_ids, options), draft


Prompt = Union[str, list[int], list[dict], mx.array]


def encode_prompt(tokenizer, prompt: Prompt, chat: bool = False, tools: Optional[list] = None) -> mx.array:
    """Token ids of a prompt: ids as given; text as is, or in the chat template (``chat``);
    a list of chat messages ({"role", "content"} dicts) always in the chat template, which
    also lists ``tools`` (OpenAI's function definitions) where given."""
    is_messages = isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
    if chat or is_messages:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DFlashError("the tokenizer has no chat template: pass a plain prompt")
        if not is_messages and not isinstance(prompt, str):
            raise DFlashError("chat needs a text prompt or a list of {'role', 'content'} messages")
        messages = prompt if is_messages else [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               **({"tools": tools} if tools else {}))
    elif isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    elif not isinstance(prompt, mx.array) and not all(isinstance(t, Integral) and t >= 0 for t in prompt):
        raise DFlashError("a prompt of token ids takes non-negative integers")  # (the caller's own ids only)
    prompt = mx.array(prompt, dtype=mx.uint32) if not isinstance(prompt, mx.array) else prompt.astype(mx.uint32)
    if prompt.ndim != 1 or prompt.size == 0:
        raise DFlashError("the prompt is empty")
    return prompt


def bound_by_context(model: nn.Module, prompt_tokens: int, max_tokens: int) -> int:
    """``max_tokens`` cut to what fits in the model's context after the prompt; a prompt that
    leaves no room is refused (past the context a model's output is garbage)."""
    context = context_length(model)
    if context is None:
        return max_tokens
    if prompt_tokens >= context:
        raise DFlashError(f"the prompt ({prompt_tokens} tokens) does not fit the model's context of {context} tokens")
    return min(max_tokens, context - prompt_tokens)


def _continue_after(detokenizer, prompt: mx.array) -> None:
    """Prime the detokenizer with the prompt's last tokens, so that the first generated token
    keeps its leading space (a completions client appends our text to its prompt)."""
    for token in prompt[-CONTINUATION_TOKENS:].tolist():
        detokenizer.add_token(token)
    detokenizer.finalize()


class TextStream:
    """One generation's committed tokens in, its text out: ends at the first EOS (not emitted),
    at ``max_tokens`` tokens, or at the first stop string (text cut before it; tokens end with
    the one completing it). Holds back the characters that may start a stop string."""

    def __init__(self, tokenizer, prompt: mx.array, max_tokens: int, stop: Optional[Sequence[str]] = None,
                 continuation: bool = False):
        self.max_tokens = max_tokens
        self.stops = [s for s in (stop or []) if s]
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1  # chars that may start a stop string
        self.eos = set(tokenizer.eos_token_ids)
        self.detokenizer = tokenizer.detokenizer
        if continuation:
            _continue_after(self.detokenizer, prompt)
        self.start_chars = self.sent_chars = len(self.detokenizer.text)  # (the primed prompt's text is not ours)
        self.tokens: list[int] = []
        self.finish_reason: Optional[str] = None

    def add(self, committed: Sequence[int]) -> tuple[str, list[int]]:
        """The text these committed tokens complete and the tokens of them that count; sets
        ``finish_reason`` ("stop" or "length") when the generation ends with them."""
        finish, cut, new = None, None, []
        for token in committed:
            if token in self.eos:
                finish = "stop"
                break
            self.tokens.append(token)
            new.append(token)
            self.detokenizer.add_token(token)
            if self.stops:
                cut = _find_stop(self.detokenizer.text, self.stops, max(self.start_chars, self.sent_chars - self.hold_back))
                if cut is not None:
                    finish = "stop"
                    break
            if len(self.tokens) == self.max_tokens:
                finish = "length"
                break
        if finish:
            self.detokenizer.finalize()
        text = self.detokenizer.text
        end = cut if cut is not None else (len(text) if finish else max(self.sent_chars, len(text) - self.hold_back))
        segment, self.sent_chars = text[self.sent_chars : end], max(self.sent_chars, end)
        self.finish_reason = finish
        return segment, new


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Prompt,
    draft: Union[DFlashDraft, Proposer],
    max_tokens: int = 256,
    block_size: Optional[int] = None,
    stop: Optional[Sequence[str]] = None,
    sampling: Optional[SamplingParams] = None,
    adaptive: Union[bool, BlockPolicy] = False,
    options: EngineOptions = DEFAULT_OPTIONS,
    chat: bool = False,
    continuation: bool = False,
    prompt_progress: Optional[ProgressCallback] = None,
    warmup: bool = False,
    trees: Union[bool, int] = False,
    prefix_cache: Optional[PrefixCache] = None,
) -> Iterator[StreamResponse]:
    """Stream DFlash output; each response carries one cycle's text and statistics.

    ``prompt``: text, token ids, or chat messages ([{"role": ..., "content": ...}], put in the
    tokenizer's chat template); ``chat=True`` puts a text prompt in the template as a user turn.
    Output ends at the first EOS (not emitted), at ``max_tokens`` tokens or the model's context,
    or at the first stop string (text cut before it; tokens end with the one completing it).
    ``continuation``: the text continues the prompt's exactly (a leading space is kept).
    ``prompt_progress(done, total)`` is called after each prefill chunk.
    ``sampling``: temperature, top-p/k, min-p, logits processors and seed (default greedy).
    ``adaptive``: choose each cycle between plain decoding and full blocks by measured
    speed (``policy.py``); the output is the same either way. Not with a seeded
    sampler: timing-dependent blocks would consume random draws differently, and the
    same seed must give the same text. A ``BlockPolicy`` instead of True keeps the costs it
    measured for the next call (a server's or a benchmark's many generations).
    ``options``: how the engine runs (``options.py``; the output does not depend on them).
    ``warmup``: first run every path of a generation once (``warmup.py``), so that on a GPU
    the first generation of a process does not compile kernels while it is timed.
    ``trees``: verify trees of drafts (``tree.py``) where the adaptive policy measures them
    faster (True: budgets ``policy.TREE_BUDGETS``), never (False, the default), or with a budget
    B: the policy's one tree, and with fixed blocks every full block a tree of B nodes. Targets
    with recurrent layers verify chains.
    ``prefix_cache``: restore the longest stored start of the prompt instead of prefilling it,
    and store this prompt's state for later ones (``prefix_cache.py``; same tokens as without).
    A model runs one generation at a time, from one thread at a time (its wrapped layers record
    into one place); the server serves many requests through its one model thread.
    """
    target, proposer = make_proposer(model, draft, options)
    block_size = proposer.block_size if block_size is None else block_size
    check_block_size(block_size, proposer.block_size)
    if max_tokens < 1:
        raise DFlashError(f"max_tokens must be at least 1, got {max_tokens}")
    prompt = encode_prompt(tokenizer, prompt, chat)
    max_tokens = bound_by_context(model, prompt.size, max_tokens)
    output = TextStream(tokenizer, prompt, max_tokens, stop, continuation)
    prefill_s, reused = 0.0, 0
    if sampling is not None and sampling.greedy and not sampling.logits_processors:
        sampling = None  # plain greedy: the bit-exact path
    seeded = sampling is not None and sampling.seed is not None
    policy = None
    if adaptive and not seeded:
        policy = adaptive if isinstance(adaptive, BlockPolicy) else BlockPolicy(block_size, tree_budgets=tree_budgets(trees))
        if policy.max_block != block_size:
            raise DFlashError(f"the adaptive policy is for blocks of up to {policy.max_block}, not {block_size}")
    fixed_tree = fixed_tree_budget(trees) if policy is None else None
    if fixed_tree is not None:
        check_tree_budget(fixed_tree, block_size, fixed=True)
    if warmup:  # (before the policy's first text: it learns the block costs)
        warm_up(model, proposer, block_size, options, policy=policy, tree_budget=fixed_tree)
    if policy is not None:
        policy.start_text()
    tic = time.perf_counter()
    cycles = decode_cycles(target, proposer, prompt, max_tokens, block_size, sampling, policy, prompt_progress,
                           tree_budget=fixed_tree, prefix_cache=prefix_cache)
    with closing(cycles):  # (closed at once, not when collected: a prefix cache keeps the reply then)
        for n_cycle, cycle in enumerate(cycles):
            if n_cycle == 0:
                prefill_s, reused = time.perf_counter() - tic, cycle.reused_prompt_tokens
                tic = time.perf_counter()
            segment, new = output.add(cycle.tokens)
            finish = output.finish_reason
            elapsed = time.perf_counter() - tic
            yield StreamResponse(
                text=segment,
                tokens=new,
                acceptance_length=cycle.acceptance_length,
                cycle=n_cycle,
                prompt_tokens=prompt.size,
                prefill_seconds=prefill_s,
                generation_tokens=len(output.tokens),
                decode_tokens_per_sec=max(len(output.tokens) - 1, 0) / elapsed if elapsed > 0 else 0.0,
                finish_reason=finish,
                reused_prompt_tokens=reused,
            )
            if finish:
                if target.group is not None:
                    check_agreement(output.tokens, target.group)
                return


def generate(
    model: nn.Module,
    tokenizer,
    prompt: Prompt,
    draft: Union[DFlashDraft, Proposer],
    **kwargs,
) -> GenerationResult:
    """Run ``stream_generate`` to completion and collect tokens, text and statistics."""
    tokens: list[int] = []
    pieces: list[str] = []
    acceptance: list[int] = []
    tic = time.perf_counter()
    last = None
    for last in stream_generate(model, tokenizer, prompt, draft, **kwargs):
        tokens += last.tokens
        pieces.append(last.text)
        if last.acceptance_length is not None:
            acceptance.append(last.acceptance_length)
    total = time.perf_counter() - tic
    decode_s = total - last.prefill_seconds
    return GenerationResult(
        tokens=tokens,
        text="".join(pieces),
        prompt_tokens=last.prompt_tokens,
        prefill_seconds=last.prefill_seconds,
        decode_seconds=decode_s,
        decode_tokens_per_sec=max(len(tokens) - 1, 0) / decode_s if decode_s > 0 else 0.0,
        cycles=len(acceptance),
        acceptance_lengths=acceptance,
        finish_reason=last.finish_reason,
        reused_prompt_tokens=last.reused_prompt_tokens,
    )


def generate_text_stats(last: StreamResponse, acceptance: Sequence[int], block_size: int) -> str:
    """The one-line summary printed after a generation."""
    mean = sum(acceptance) / max(len(acceptance), 1)
    return (
        f"prefill {last.prefill_seconds:.3f}s ({last.prompt_tokens} tokens) | "
        f"decode {last.decode_tokens_per_sec:.1f} tok/s ({last.generation_tokens} tokens, {len(acceptance)} cycles) | "
        f"mean acceptance length {mean:.2f} | acceptance rate {(mean - 1) / max(block_size - 1, 1):.1%}"
    )
