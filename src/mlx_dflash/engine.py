"""The DFlash decode loop: prefill, draft, verify, accept, roll back.

Read ``decode_cycles`` top to bottom: it is the whole algorithm. Everything
else here turns its token ids into text, stop handling and statistics.

One device-to-host sync per cycle: the target's choices (which also give the
accept count) are read once. When every cache of the target can be cut by a count
still on the device (``Target.rolls_back_on_device``: KV and Gated DeltaNet caches),
greedy decoding rolls back, extends the draft's context and picks the next block's
first token on the device, and queues the next cycle before the host reads this
one's count: the host builds a cycle's graph while the device runs the previous one,
as mlx-lm's own decode loop does for single tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from .device import on_gpu
from .draft import DFlashDraft
from .errors import DFlashError
from .policy import BlockPolicy
from .sampling import SamplingParams, draft_tokens, first_token, matching_prefix, verify
from .target import Target, check_compatible, context_length

PREFILL_STEP = 2048
CONTINUATION_TOKENS = 4  # prompt tokens a continuation's detokenizer is primed with


class Proposer(Protocol):
    """Anything that drafts a block: the DFlash draft, or a replay for tests/benchmarks."""

    layer_ids: list[int]  # target layers whose outputs it consumes
    block_size: int  # the largest block it drafts for

    def start(self, target: Target) -> None:
        """Begin a new sequence."""

    def add_context(self, features: mx.array, kept: Union[None, int, mx.array] = None) -> None:
        """Tapped target features [1, n, K*H] of newly verified tokens, of which the first
        ``kept`` are committed (None: all n; may be a count still on the device)."""

    def settle(self, positions: int) -> None:
        """The host has read the counts: ``positions`` committed tokens have context now."""

    @property
    def state(self) -> list:
        """The arrays its stored context is in: the prefill evaluates them (a prompt's context
        is prompt work; left to the first draft, it was timed as decoding)."""

    def propose(self, first_token: mx.array, num_tokens: int) -> mx.array:
        """Draft ``num_tokens`` tokens following ``first_token`` (shape [1])."""


class DFlashProposer:
    """Greedy block drafts from a DFlash draft model, using the target's embedding and head."""

    def __init__(self, draft: DFlashDraft):
        self.draft = draft
        self.layer_ids = draft.config.target_layer_ids
        self.block_size = draft.block_size
        self.mask_id = mx.array([draft.config.mask_token_id], dtype=mx.uint32)
        vocab = draft.config.draft_vocab
        self.draft_vocab = mx.array(vocab, dtype=mx.uint32) if vocab else None

    def start(self, target: Target) -> None:
        self.target = target
        self.cache = self.draft.make_cache()
        self.single: list[mx.array] = []  # tapped features of single tokens (plain steps), not stored yet
        # greedy drafts pick among the draft vocabulary only (when it has one): a smaller head
        self.vocab_head = target.head_rows(self.draft_vocab) if self.draft_vocab is not None else None

    def add_context(self, features: mx.array, kept: Union[None, int, mx.array] = None) -> None:
        if isinstance(kept, int):
            features, kept = features[:, :kept], None
        # Plain steps add one token each: stored together at the next draft, not one by one
        # (a few ops fewer per step, where a small model on a GPU is launch-bound).
        if features.shape[1] == 1 and kept is None:
            self.single.append(features)
            return
        self._store_singles()
        self.draft.store_context(self.draft.project_context(features), self.cache, kept)

    def settle(self, positions: int) -> None:
        if not self.single:  # (else the cache does not hold them all yet)
            for layer_cache in self.cache:
                layer_cache.settle(positions)

    @property
    def state(self) -> list:
        return [layer_cache.state for layer_cache in self.cache]

    def _store_singles(self) -> None:
        if self.single:
            self.draft.store_context(self.draft.project_context(mx.concatenate(self.single, axis=1)), self.cache)
            self.single = []

    def _slot_hidden(self, first_token: mx.array, num_tokens: int) -> mx.array:
        """Final hidden states [1, num_tokens, H] of the block slots after ``first_token``."""
        block = mx.concatenate([first_token.astype(mx.uint32), mx.repeat(self.mask_id, num_tokens)])
        self._store_singles()
        return self.draft.run_block(self.target.embed(block[None]), self.cache)[:, 1:]

    def draft_logits(self, first_token: mx.array, num_tokens: int) -> mx.array:
        """Logits [num_tokens, V] over the whole vocabulary (one draft pass): what sampling needs."""
        return self.target.head(self._slot_hidden(first_token, num_tokens))[0]

    def propose(self, first_token: mx.array, num_tokens: int) -> mx.array:
        """Greedy drafts (one draft pass), from the draft vocabulary if it has one."""
        if self.vocab_head is None:
            return mx.argmax(self.draft_logits(first_token, num_tokens), axis=-1)
        logits = self.vocab_head(self._slot_hidden(first_token, num_tokens))[0]
        return self.draft_vocab[mx.argmax(logits, axis=-1)]


@dataclass
class Cycle:
    """Tokens committed by one step: the prefill's first token, or a verified block."""

    tokens: list[int]
    acceptance_length: Optional[int]  # a + 1 for a verify cycle; None for the prefill token


ProgressCallback = Callable[[int, int], None]  # (prompt tokens processed, prompt tokens)


def _prefill(target: Target, proposer: Proposer, prompt: mx.array, cache: list[Any],
             progress: Optional[ProgressCallback] = None) -> mx.array:
    """Run the prompt through the target as mlx-lm's ``generate_step`` does: all but its last
    token in chunks, then the last token alone; return that token's logits. (The same calls
    give the same kernels: a token's logits from a one-row pass and from the last row of a
    chunk differ in their last bits, enough to flip a bf16 near-tie on a GPU.)"""
    for start in range(0, prompt.size - 1, PREFILL_STEP):
        end = min(start + PREFILL_STEP, prompt.size - 1)
        _, features = target(prompt[None, start:end], cache, prompt=True)
        proposer.add_context(features)
        mx.eval([c.state for c in cache], proposer.state)
        if progress is not None:
            progress(end, prompt.size)
    logits, features = target(prompt[None, -1:], cache)
    proposer.add_context(features)
    return logits[0, -1]


def decode_cycles(
    target: Target,
    proposer: Proposer,
    prompt: mx.array,
    max_tokens: int,
    block_size: int,
    sampling: Optional[SamplingParams] = None,
    policy: Optional[BlockPolicy] = None,
    queue_ahead: Optional[bool] = None,
    prompt_progress: Optional[ProgressCallback] = None,
) -> Iterator[Cycle]:
    """DFlash decoding; yields committed tokens cycle by cycle, at most ``max_tokens``.

    ``sampling=None`` is plain greedy; otherwise see ``sampling.py`` (lossless sampling).
    ``policy`` picks each cycle's block size (up to ``block_size``) from measured speed.
    ``queue_ahead``: queue each greedy block before reading the previous one's accept count
    (where the target allows it); None: on GPUs, where the host's work is a cycle's cost.
    """
    cache = target.make_cache()
    proposer.start(target)
    if sampling is not None and sampling.seed is not None:
        mx.random.seed(sampling.seed)
    history = prompt.tolist()  # committed tokens before the current block, for logits processors
    bonus = first_token(sampling, _prefill(target, proposer, prompt, cache, prompt_progress)[None], prompt)  # [1]

    launched = 0.0  # host seconds spent in ``launch`` since the latest sync

    def launch(first: mx.array, block_len: int, forecast: bool = False):
        """Draft and verify one block (lazily); queue it on the device. Drafted tokens past
        the verified ones (``guess``) are for the policy to check against the coming tokens
        (``policy.py``): with ``forecast``, a full block's drafts beside a plain step; with any policy, one
        token past a greedy block, to check against its bonus token if the block is accepted.
        Also returns the host seconds it took (the policy's costs: see the loop)."""
        nonlocal launched
        tic = time.perf_counter()
        n = block_len - 1
        before = mx.array(history, dtype=mx.uint32) if sampling and sampling.logits_processors else None
        guess = None
        if n == 0 and sampling is None:  # a plain greedy step, in as few ops as mlx-lm's: nothing to
            logits, features = target(first[None], cache)  # match (a small model on a GPU is launch-bound)
            tokens, accepted = mx.argmax(logits[0], axis=-1), None
        else:
            if n == 0:
                drafted, q = first[:0], None
            elif sampling is None:
                peek = policy is not None and block_len < block_size  # (the policy's slots: 1..block_size-1)
                drafted, q = proposer.propose(first, n + peek).astype(mx.uint32), None
                if peek:
                    drafted, guess = drafted[:n], drafted[n:]
            elif hasattr(proposer, "draft_logits"):
                drafted, q = draft_tokens(sampling, proposer.draft_logits(first, n), before, first)
            else:  # a proposer without distributions (replay): its proposal is certain, q is one-hot
                drafted = proposer.propose(first, n).astype(mx.uint32)
                exact = sampling.greedy or sampling.accept == "match"
                q = None if exact else (mx.arange(target.vocab_size)[None] == drafted[:, None]).astype(mx.float32)
            block = mx.concatenate([first, drafted])
            logits, features = target(block[None], cache)
            if sampling is None:
                tokens = mx.argmax(logits[0], axis=-1)  # the target's own choice after each slot (uint32)
                accepted = matching_prefix(drafted, tokens)
            else:
                tokens, accepted = verify(sampling, logits[0], before, block, drafted, q)
        if forecast:
            guess = proposer.propose(first, block_size - 1)
        mx.async_eval(tokens, features, *(x for x in (accepted, guess) if x is not None))
        seconds = time.perf_counter() - tic
        launched += seconds
        return tokens, accepted, features, guess, seconds

    def keep_prefix(tokens: mx.array, features: mx.array, a: Union[int, mx.array]) -> mx.array:
        """A verified block with ``a`` drafts accepted (read, or still on the device): drop
        the rejected drafts from the caches (the bonus is not cached), add the kept tokens'
        context; the next block's first token (the bonus, [1])."""
        target.rollback(cache, tokens.size - 1 - a)
        proposer.add_context(features, a + 1)
        return tokens[a : a + 1] if isinstance(a, int) else tokens[a.reshape(1)]

    def next_block(uncounted: int = 0) -> tuple[int, bool]:
        """The next block's size and whether it carries a forecast; ``uncounted``: tokens of
        the current cycle not yet in ``emitted``."""
        wanted = max_tokens - emitted - uncounted
        if not policy:
            return min(block_size, wanted), False
        return policy.choose(limit=wanted), policy.wants_forecast

    # Plain decoding (block size 1) needs no accept count to pick its next input; nor do blocks
    # when every cache of the target rolls back by a count still on the device (greedy only:
    # sampling reads its random draws' outcome on the host). Then, like mlx-lm's generate_step,
    # the next cycle is queued before the host waits for this one: its graph is built while
    # the device runs this one. (Not with logits processors: they read the history on the host.
    # Blocks not on the CPU: there the arithmetic is the cost, and queued blocks measured no faster.)
    can_queue_ahead = not (sampling and sampling.logits_processors)
    queue_blocks = sampling is None and target.rolls_back_on_device and (on_gpu() if queue_ahead is None else queue_ahead)
    emitted, bonus_id = 1, bonus.item()
    yield Cycle([bonus_id], None)
    # A cycle's cost for the policy: the window from the previous sync to its own, with the
    # launches in it swapped for the cycle's own launch. A window holds the wait for this cycle
    # and a launch: this cycle's (built after the previous sync), or, when the next cycle is
    # queued ahead, the next one's (on a GPU most of the window: the host is the bottleneck,
    # so a plain step followed by a block would be charged the block's launch, and the block
    # a plain step's). A launch is graph building and, on the CPU, most of the run (there
    # `mx.async_eval` of a large graph returns only near the end of it).
    synced = time.perf_counter()
    pending = launch(bonus, *next_block()) if emitted < max_tokens else None
    while pending is not None:
        tokens, accepted, features, guess, own_launch = pending
        block_len = tokens.size
        queued = choice = None
        settled_on_device = block_len == 1 or queue_blocks
        if settled_on_device:  # roll back, add context and pick the next first token on the device
            if accepted is None:  # a plain greedy step keeps its token
                proposer.add_context(features)
                bonus = tokens
            else:  # (a sampled one-token block has nothing to roll back: its count is the host's 0)
                bonus = keep_prefix(tokens, features, 0 if block_len == 1 else accepted[0])
            if (queue_blocks or can_queue_ahead) and emitted + 1 < max_tokens:
                choice = next_block(uncounted=1)
                queued = launch(bonus, *choice) if queue_blocks or choice[0] == 1 else None
        a = 0 if accepted is None else accepted.item()  # the cycle's single device-to-host sync
        whole = a + 1 == block_len
        # a accepted drafts, then the bonus (a plain step's sync is this tolist: its token is kept);
        # sliced on the host: a slice is a new array, and reading it waits for everything queued
        # before it, the next cycle included (H200, Qwen3.5-9B replay: 4.55x of mlx-lm against
        # 3.96x; BENCHMARKS.md, twenty-fifth session)
        committed = tokens.tolist()[: a + 1]
        if policy:
            forecast = guess is not None and block_len == 1  # its time holds a draft pass
            seconds = time.perf_counter() - synced - launched + own_launch
            policy.record(block_len, a + 1, seconds, forecast=forecast)
            synced, launched = time.perf_counter(), 0.0
            if guess is not None and whole:  # the draft's guesses from this cycle's last token on
                policy.start_forecast(guess.tolist(), first_slot=block_len)
                policy.observe(committed[-1:])
            else:
                policy.observe(committed)
        if not settled_on_device:
            bonus = keep_prefix(tokens, features, a)
        committed = committed[: max_tokens - emitted]  # (a block queued ahead may pass the end)
        history += [bonus_id] + committed[:-1]  # history: every token before the next block's first
        emitted += len(committed)
        bonus_id = committed[-1]
        if queue_blocks:  # the counts are read: attention and the draft look no further than needed
            in_context = prompt.size + emitted - 1  # every committed token but the latest bonus
            exact = queued is None or queued[1] is None  # (a queued plain step keeps its token)
            target.settle(cache, in_context + (queued[0].size if queued is not None else 0), exact)
            proposer.settle(in_context)
        if emitted >= max_tokens:
            pending = None
        elif queued is not None:
            pending = queued
        else:
            pending = launch(bonus, *(choice or next_block()))
        yield Cycle(committed, min(a + 1, len(committed)))


# ---------------------------------------------------------------------------
# Text, stops and statistics


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

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


def _find_stop(text: str, stops: Sequence[str], search_from: int) -> Optional[int]:
    hits = [i for i in (text.find(s, search_from) for s in stops) if i >= 0]
    return min(hits) if hits else None


def make_proposer(model: nn.Module, draft: Union[DFlashDraft, Proposer]) -> tuple[Target, Proposer]:
    if isinstance(draft, DFlashDraft):
        check_compatible(draft, model)
        draft = DFlashProposer(draft)
    return Target(model, draft.layer_ids), draft


Prompt = Union[str, list[int], list[dict], mx.array]


def encode_prompt(tokenizer, prompt: Prompt, chat: bool = False) -> mx.array:
    """Token ids of a prompt: ids as given; text as is, or in the chat template (``chat``);
    a list of chat messages ({"role", "content"} dicts) always in the chat template."""
    is_messages = isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
    if chat or is_messages:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DFlashError("the tokenizer has no chat template: pass a plain prompt")
        messages = prompt if is_messages else [{"role": "user", "content": prompt}]
        if not all(isinstance(m, dict) for m in messages) or (not is_messages and not isinstance(prompt, str)):
            raise DFlashError("chat needs a text prompt or a list of {'role', 'content'} messages")
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    elif isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
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
    queue_ahead: Optional[bool] = None,
    chat: bool = False,
    continuation: bool = False,
    prompt_progress: Optional[ProgressCallback] = None,
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
    ``queue_ahead``: see ``decode_cycles`` (default: on GPUs).
    """
    target, proposer = make_proposer(model, draft)
    block_size = proposer.block_size if block_size is None else block_size
    if not 1 <= block_size <= proposer.block_size:
        raise DFlashError(f"block size must be in 1..{proposer.block_size} (the draft's), got {block_size}")
    if max_tokens < 1:
        raise DFlashError(f"max_tokens must be at least 1, got {max_tokens}")
    stops = [s for s in (stop or []) if s]
    hold_back = max((len(s) for s in stops), default=1) - 1  # chars that may start a stop string
    prompt = encode_prompt(tokenizer, prompt, chat)
    max_tokens = bound_by_context(model, prompt.size, max_tokens)
    eos = set(tokenizer.eos_token_ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    if continuation:
        _continue_after(detokenizer, prompt)
    start_chars = sent_chars = len(detokenizer.text)  # (the primed prompt's text is not ours)

    tokens: list[int] = []
    tic = time.perf_counter()
    prefill_s = 0.0
    if sampling is not None and sampling.greedy and not sampling.logits_processors:
        sampling = None  # plain greedy: the bit-exact path
    seeded = sampling is not None and sampling.seed is not None
    policy = None
    if adaptive and not seeded:
        policy = adaptive if isinstance(adaptive, BlockPolicy) else BlockPolicy(block_size)
        if policy.max_block != block_size:
            raise DFlashError(f"the adaptive policy is for blocks of up to {policy.max_block}, not {block_size}")
        policy.start_text()
    cycles = decode_cycles(target, proposer, prompt, max_tokens, block_size, sampling, policy, queue_ahead,
                           prompt_progress)
    for n_cycle, cycle in enumerate(cycles):
        if n_cycle == 0:
            prefill_s = time.perf_counter() - tic
            tic = time.perf_counter()
        finish, cut, new = None, None, []
        for token in cycle.tokens:
            if token in eos:
                finish = "stop"
                break
            tokens.append(token)
            new.append(token)
            detokenizer.add_token(token)
            if stops:
                text = detokenizer.text
                cut = _find_stop(text, stops, max(start_chars, sent_chars - hold_back))
                if cut is not None:
                    finish = "stop"
                    break
            if len(tokens) == max_tokens:
                finish = "length"
                break
        if finish:
            detokenizer.finalize()
        text = detokenizer.text
        end = cut if cut is not None else (len(text) if finish else max(sent_chars, len(text) - hold_back))
        segment, sent_chars = text[sent_chars:end], max(sent_chars, end)
        elapsed = time.perf_counter() - tic
        yield StreamResponse(
            text=segment,
            tokens=new,
            acceptance_length=cycle.acceptance_length,
            cycle=n_cycle,
            prompt_tokens=prompt.size,
            prefill_seconds=prefill_s,
            generation_tokens=len(tokens),
            decode_tokens_per_sec=max(len(tokens) - 1, 0) / elapsed if elapsed > 0 else 0.0,
            finish_reason=finish,
        )
        if finish:
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
    )


def generate_text_stats(last: StreamResponse, acceptance: Sequence[int], block_size: int) -> str:
    """The one-line summary printed after a generation."""
    mean = sum(acceptance) / max(len(acceptance), 1)
    return (
        f"prefill {last.prefill_seconds:.3f}s ({last.prompt_tokens} tokens) | "
        f"decode {last.decode_tokens_per_sec:.1f} tok/s ({last.generation_tokens} tokens, {len(acceptance)} cycles) | "
        f"mean acceptance length {mean:.2f} | acceptance rate {(mean - 1) / max(block_size - 1, 1):.1%}"
    )
