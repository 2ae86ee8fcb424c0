"""Continuous batching (batch.py): rows decoded together give, token for token, mlx-lm's greedy
output of each prompt alone, with mixed prompt lengths, rows that finish at different cycles,
rows that join mid-way and rows that leave early; with a real (random) draft and with planted
drafts that make each row accept a different number of tokens every cycle."""

import dataclasses
import json
import random
from typing import Optional

import mlx.core as mx
import pytest
from tiny_models import FAMILIES, MASK_ID, MORE_FAMILIES, greedy_reference, load_tiny, make_tiny_target

from mlx_dflash import create_random_draft
from mlx_dflash.batch import BatchDecoder, batch_generate
from mlx_dflash.draft import DFlashDraft
from mlx_dflash.draft_config import DFlash2Config
from mlx_dflash.engine import prefill
from mlx_dflash.options import EngineOptions
from mlx_dflash.policy import BlockPolicy
from mlx_dflash.proposer import DFlashProposer
from mlx_dflash.sampling import sample
from mlx_dflash.target import Target

PROMPTS = [list(range(40, 40 + n)) for n in (5, 17, 30, 9, 12)]
LIMITS = [20, 7, 33, 1, 26]
BLOCK = 8


@pytest.fixture(scope="module", params=sorted(set(FAMILIES) | set(MORE_FAMILIES)))
def pair(request, tiny_dir):
    path = make_tiny_target(tiny_dir / f"batch-{request.param}", request.param)
    model, _ = load_tiny(path)
    config = json.loads((path / "config.json").read_text())
    draft = create_random_draft(config, num_layers=2, block_size=BLOCK, mask_token_id=MASK_ID)
    references = [greedy_reference(model, p, n) for p, n in zip(PROMPTS, LIMITS)]
    return model, draft, references


class PlantedDrafts(BatchDecoder):
    """Drafts each row's own greedy continuation with a mistake at a random slot (or none),
    so rows accept different counts each cycle; the draft still runs, for its context. Each
    row's place in its continuation comes from its length on the device: a cycle queued ahead
    is drafted before the host has read the previous one's counts."""

    def __init__(self, *args, references: dict, seed: int = 0):
        super().__init__(*args)
        self.references, self.rng, self.accepted = references, random.Random(seed), []

    def _draft(self, first: mx.array, L: int) -> tuple[mx.array, dict]:
        super()._draft(first, L)
        references = [self.references.get(row.id, []) for row in self.slots]  # (an idle slot's: none)
        width = max(map(len, references)) + L
        continuations = mx.array([(r + [0] * width)[:width] for r in references], dtype=mx.uint32)
        done = mx.minimum(self.context[0].position - mx.array([len(row.prompt) - 1 for row in self.slots]), width - L)
        slots = mx.take_along_axis(continuations, done[:, None] + mx.arange(L - 1), axis=1)
        wrong = mx.array([self.rng.randrange(L) for _ in self.slots])[:, None] == mx.arange(L - 1)  # (L - 1: all right)
        return mx.where(wrong, (slots + 1) % 200, slots).astype(mx.uint32), {}


# The GPU's cycle: the next queued before a read, and finished rows' slots left idle in a batch
# of a power-of-two rows.
QUEUED = EngineOptions(queue_ahead=True, compile_blocks=True, pad_rows=True)
BEHIND = dataclasses.replace(QUEUED, join_behind=True)  # (rows joining while a cycle is queued prefilled behind it)


def queues(decoder: BatchDecoder) -> list:
    """Records, per step, whether a cycle was left queued (a test's check that the path ran)."""
    seen, step = [], decoder.step
    decoder.step = lambda: (step(), seen.append(decoder.queued is not None))[0]
    return seen


def decode_planted(decoder: PlantedDrafts, references: list) -> list:
    """Every prompt's tokens, all rows joining before the first cycle, each row's drafts planted."""
    outputs = {}
    for index, (prompt, limit) in enumerate(zip(PROMPTS, LIMITS)):
        row = decoder.add(mx.array(prompt), limit)
        decoder.references[row.id] = references[index]
        outputs[row.id] = list(row.tokens)
    while decoder.rows:
        for row, tokens in decoder.step().items():
            outputs[row] += tokens
    return list(outputs.values())


def test_batch_equals_each_prompt_alone(pair):
    model, draft, references = pair
    assert batch_generate(model, PROMPTS, draft, LIMITS) == references


class PlantedCosts(BlockPolicy):
    """Sees a block of 8 cost 3 plain steps (a CPU's ratio) whatever this machine measures, so
    that its choices depend on acceptance alone."""

    def record_rows(self, block: int, acceptances: list[int], seconds: float, forecast: bool = False) -> None:
        super().record_rows(block, acceptances, 0.01 * (1 + block / 4), forecast)  # (``record`` calls it too)


@pytest.mark.parametrize("planted, queued", [(False, False), (True, False), (True, True)])
def test_adaptive_block_sizes_equal_each_prompt_alone(pair, planted, queued):
    """With a policy choosing each cycle's size (plain steps with forecasts, short blocks, full
    ones); ``queued``: each cycle's size chosen before the previous one is read."""
    model, draft, references = pair
    policy = PlantedCosts(BLOCK)
    policy.history = []
    options = QUEUED if queued else EngineOptions()
    decoder = PlantedDrafts(model, draft, BLOCK, None, policy, options, references={}) if planted else (
        BatchDecoder(model, draft, BLOCK, None, policy))
    outputs = {}
    for index, (prompt, limit) in enumerate(zip(PROMPTS, LIMITS)):
        row = decoder.add(mx.array(prompt), limit)
        if planted:
            decoder.references[row.id] = references[index]
        outputs[row.id] = list(row.tokens)
    while decoder.rows:
        for row, tokens in decoder.step().items():
            outputs[row] += tokens
    assert [outputs[i] for i in range(len(PROMPTS))] == references
    sizes = {block for block, *_ in policy.history}
    assert BLOCK in sizes and (planted or 1 in sizes and any(forecast for *_, forecast in policy.history))


JOINS = {"eager": EngineOptions(), "queued": QUEUED, "behind": BEHIND, "behind, rows not padded":
         dataclasses.replace(BEHIND, pad_rows=False)}


@pytest.mark.parametrize("way", JOINS)
def test_planted_acceptance_rows_join_and_leave(pair, way):
    """Rows join mid-way (queued: while a cycle is queued, read first; behind: prefilled behind it)."""
    model, draft, references = pair
    queued = way != "eager"
    decoder = PlantedDrafts(model, draft, BLOCK, None, None, JOINS[way], references={})
    outputs, accepted, while_queued = {}, [], []
    pending = list(zip(range(len(PROMPTS)), PROMPTS, LIMITS))

    def join(count):
        while_queued.append(decoder.queued is not None)
        for index, prompt, limit in pending[:count]:
            row = decoder.add(mx.array(prompt), limit)
            decoder.references[row.id] = references[index]
            outputs[row.id] = (index, list(row.tokens))
        del pending[:count]

    join(2)
    cycles = 0
    while decoder.rows or pending:
        if cycles in (1, 3):  # rows join mid-way
            join(2 if cycles == 1 else len(pending))
        for row, tokens in decoder.step().items():
            outputs[row][1].extend(tokens)  # (the last cycle of a row may commit fewer than it accepted)
            accepted.append(len(tokens) - (len(outputs[row][1]) >= LIMITS[outputs[row][0]]))
        cycles += 1
    for index, tokens in outputs.values():
        assert tokens == references[index]
    assert len(set(accepted)) > 3  # (rows accepted many different counts)
    assert any(while_queued) == (queued and decoder.target.rolls_back_on_device)


def test_batches_pad_rows_and_join_behind_by_default_on_gpus_only(monkeypatch):
    """Both measured faster on GPUs only; set, each is forced on any backend."""
    from mlx_dflash import options as options_module

    assert (EngineOptions().resolved().pad_rows, EngineOptions().resolved().join_behind) == (False, False)
    monkeypatch.setattr(options_module, "on_gpu", lambda: True)
    assert (EngineOptions().resolved().pad_rows, EngineOptions().resolved().join_behind) == (True, True)
    assert EngineOptions(join_behind=False, pad_rows=False).resolved().join_behind is False


def test_rows_joining_while_a_cycle_is_queued_are_prefilled_behind_it(pair):
    """With ``join_behind``, where cycles queue (GPUs), a row that joins while one is queued is
    prefilled behind it and nothing is read: its first token comes from the next step (after
    that cycle's tokens are read), and it merges into the cycle queued after. A row that asks
    for one token leaves there without merging; one removed before its first token is read
    leaves no trace. Every row's tokens stay its prompt's own."""
    model, draft, references = pair
    decoder = PlantedDrafts(model, draft, BLOCK, None, None, BEHIND, references={})
    behind = decoder.target.rolls_back_on_device  # (targets with rotating caches never queue: rows join at once)
    outputs, index_of = {}, {}

    def join(index: int):
        queued = decoder.queued
        row = decoder.add(mx.array(PROMPTS[index]), LIMITS[index])
        decoder.references[row.id], index_of[row.id] = references[index], index
        outputs[row.id] = list(row.tokens)
        assert decoder.queued is queued and not decoder.landed  # (nothing read)
        assert (row.tokens == []) == (queued is not None)
        return row

    for index in (0, 1):
        join(index)
    for row, tokens in decoder.step().items():  # (the first cycle; where cycles queue, the second is queued now)
        outputs[row] += tokens
    assert (decoder.queued is not None) == behind
    one_token, removed, late = join(3), join(4), join(2)  # (PROMPTS[3] asks for 1 token)
    decoder.remove(removed.id)
    slots_before = [row.id for row in decoder.slots]
    out = decoder.step()
    if behind:
        assert out[one_token.id] == [references[3][0]] and one_token.id not in decoder.rows
        assert out[late.id] == [references[2][0]] and late.id in decoder.rows
        assert removed.id not in out and late.id not in slots_before + [row.id for row in decoder.slots]
    for row, tokens in out.items():
        outputs[row] += tokens
    while decoder.rows:
        out = decoder.step()
        if behind and late.id in out and len(outputs[late.id]) == 1:
            assert late.id in [row.id for row in decoder.slots]  # (merged into the cycle queued after)
        for row, tokens in out.items():
            outputs[row] += tokens
    del outputs[removed.id]
    for row, tokens in outputs.items():
        assert tokens == references[index_of[row]], row


WAYS = {"compiled": EngineOptions(queue_ahead=False, compile_blocks=True),
        "eager": EngineOptions(queue_ahead=False, compile_blocks=False),
        "queued": QUEUED, "queued, rows not padded": dataclasses.replace(QUEUED, pad_rows=False)}


@pytest.mark.parametrize("way", WAYS)
def test_compiled_eager_and_queued_verifies_equal_each_prompt_alone(pair, way):
    """Verifies under mx.compile (a trace over every row's own length, as on GPUs), eager, and
    compiled with each cycle queued before the previous one is read (GPUs; finished rows' slots
    left idle or cut at once)."""
    model, draft, references = pair
    options = WAYS[way]
    decoder = PlantedDrafts(model, draft, BLOCK, None, None, options, references={})
    calls, compiled_block = [], decoder.target._compiled_block
    decoder.target._compiled_block = lambda *args: calls.append(args) or compiled_block(*args)
    queued = queues(decoder)
    assert decode_planted(decoder, references) == references
    plain = decoder.target.rolls_back_on_device  # (targets with rotating caches verify eager, never queued)
    assert bool(calls) == (way != "eager" and plain)
    assert any(queued) == (way.startswith("queued") and plain)


@pytest.mark.parametrize("queued", [False, True])
def test_a_row_that_leaves_early_disturbs_no_other(pair, queued):
    model, draft, references = pair
    decoder = BatchDecoder(model, draft, BLOCK, None, None, QUEUED if queued else EngineOptions())
    rows = [decoder.add(mx.array(p), n).id for p, n in zip(PROMPTS, LIMITS)]
    outputs = {row: [references[i][0]] for i, row in enumerate(rows)}
    leaving, left_queued = rows[2], queued and decoder.target.rolls_back_on_device
    for cycle in range(100):
        if not decoder.rows:
            break
        if cycle >= 2 and leaving in decoder.rows and (decoder.queued is not None) == left_queued:
            decoder.remove(leaving)  # (a client that went away; with ``queued``, while a cycle is queued)
        for row, tokens in decoder.step().items():
            outputs[row] += tokens
    for row, reference in zip(rows, references):
        if row != leaving:
            assert outputs[row] == reference
    assert outputs[leaving] == references[2][: len(outputs[leaving])] and len(outputs[leaving]) < LIMITS[2]


@pytest.mark.parametrize("behind", [False, True])
def test_padded_rows_verify_a_power_of_two_and_a_leave_keeps_the_queued_cycle(pair, behind):
    """With ``pad_rows`` (GPUs) every cycle drafts and verifies a power-of-two number of rows
    (idle slots beside the rows decoding): a finished row's slot stays idle, so the cycle
    queued behind its last is not read early; a new row takes an idle slot; the batch narrows
    once at most a quarter of it decodes. Each row's tokens stay its prompt's own."""
    model, draft, references = pair
    decoder = PlantedDrafts(model, draft, BLOCK, None, None, BEHIND if behind else QUEUED, references={})
    widths, launch = [], decoder._launch
    decoder._launch = lambda first, *args, **kwargs: widths.append(
        (first.shape[0], sum(row.id in decoder.rows for row in decoder.slots))) or launch(first, *args, **kwargs)
    pending, outputs, queued_after_leave = [0, 1, 2, 4, 1, 0], {}, []

    def join() -> None:
        index = pending.pop(0)
        row = decoder.add(mx.array(PROMPTS[index]), LIMITS[index])
        decoder.references[row.id] = references[index]
        outputs[row.id] = (index, list(row.tokens))

    for _ in range(3):
        join()
    while decoder.rows or pending:
        before = set(decoder.rows)
        for row, tokens in decoder.step().items():
            outputs[row][1].extend(tokens)
        if before - set(decoder.rows) and len(decoder.rows) >= 2:
            queued_after_leave.append(decoder.queued is not None)
        if len(decoder.rows) < 3 and pending:
            join()
    for index, tokens in outputs.values():
        assert tokens == references[index]
    assert widths[0] == (4, 3)
    for width, decoding in widths:  # (a power of two, at most twice the least)
        assert width & (width - 1) == 0 and decoding <= width <= 2 * (1 << (decoding - 1).bit_length())
    assert queued_after_leave and all(queued_after_leave) == decoder.target.rolls_back_on_device


@pytest.mark.parametrize("queued, adaptive, behind", [(False, False, False), (True, False, False), (True, True, False),
                                                      (True, False, True)])
def test_rows_that_end_at_eos_leave_in_the_step_that_gives_their_last_tokens(pair, queued, adaptive, behind):
    """Two rows reach an EOS in the same cycle (the same prompt: the same drafts and counts)
    while the next cycle is queued; a third row joins just before it, which reads that cycle
    early (``behind``: is prefilled behind it). Each finished row is in ``decoder.rows`` until
    the step that gives its last tokens and never after it, gets nothing of a cycle read as it
    leaves (whose tokens would end it again), and the row beside them goes on undisturbed;
    ``adaptive``: a policy learns from the cycles, the one read early too (whose first row had
    finished)."""
    model, draft, references = pair

    def first_new(reference: list[int]) -> Optional[int]:  # (a token first made there, early enough to queue after)
        return next((k for k in range(4, 24) if reference[k] not in reference[:k]), None)
    twin = next(p for p in PROMPTS if first_new(greedy_reference(model, p, 40)) is not None)
    other = PROMPTS[0] if twin != PROMPTS[0] else PROMPTS[1]
    reference = greedy_reference(model, twin, 40)
    end = first_new(reference)
    eos = frozenset(reference[end:]) - set(reference[:end])  # (what a row makes after its EOS ends it again)

    def decode(join_before: int) -> tuple[list, dict, list, int, list]:
        decoder = BatchDecoder(model, draft, BLOCK, None, BlockPolicy(BLOCK) if adaptive else None,
                               (BEHIND if behind else QUEUED) if queued else EngineOptions())
        rows = [decoder.add(mx.array(p), 40, eos=eos) for p in (twin, twin)]
        outputs = {row.id: list(row.tokens) for row in rows}
        misplaced, queued_then, twins_left = [], [], None
        for step in range(200):
            if step == join_before:
                queued_then.append(decoder.queued is not None)
                rows.append(decoder.add(mx.array(other), 40, eos=eos))
                outputs[rows[-1].id] = list(rows[-1].tokens)
            if not decoder.rows:
                break
            live = set(decoder.rows)
            out = decoder.step()
            if step == join_before:  # (it gave the cycle read early, or read it, and queued the next, if a row is left)
                queued_then.append(decoder.queued is not None if decoder.rows else "no row left")
            for row, tokens in out.items():
                misplaced.append(row not in live)  # (given tokens after it left)
                outputs[row] += tokens
            misplaced += [r not in out for r in live - set(decoder.rows)]  # (left in a step not giving its last tokens)
            if twins_left is None and rows[0].id not in decoder.rows:
                twins_left = step
        return rows, outputs, misplaced, twins_left, queued_then

    twins_left = decode(join_before=-1)[3]
    rows, outputs, misplaced, _, queued_then = decode(join_before=twins_left)
    assert not any(misplaced)
    assert [row.tokens for row in rows] == [outputs[row.id] for row in rows]  # (a row's record: what it reported)

    def through_eos(tokens: list[int]) -> list[int]:
        return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))]
    for row, prompt in zip(rows, (twin, twin, other)):
        tokens = outputs[row.id]
        assert through_eos(tokens) == through_eos(greedy_reference(model, prompt, 40))[: len(through_eos(tokens))]
        assert len(tokens) < len(through_eos(tokens)) + BLOCK  # (the ending cycle's later tokens at most)
    assert len(through_eos(outputs[rows[0].id])) == end + 1
    expected = queued and decoder_queues(model, draft)
    assert queued_then[0] == expected and queued_then[1] in (expected, "no row left")


def decoder_queues(model, draft) -> bool:
    """Whether a batch of this target queues cycles ahead (targets with rotating caches do not)."""
    return BatchDecoder(model, draft, BLOCK, None, None, QUEUED).target.rolls_back_on_device


def sliding(draft: DFlashDraft, causal: bool) -> DFlashDraft:
    """The draft with a sliding window of 4 in its last layer, causal (v1's rule) or two-sided
    (``is_causal: false``, DFlash2's)."""
    layers = len(draft.layers)
    windowed = DFlashDraft(dataclasses.replace(draft.config, sliding_window=4, is_causal=causal,
                                               layer_types=["full_attention"] * (layers - 1) + ["sliding_attention"]))
    windowed.update(draft.parameters())
    mx.eval(windowed.parameters())
    return windowed


def v2_draft(model) -> DFlashDraft:
    """A DFlash2 draft with non-identity convolutions and selector (as a trained one has)."""
    from test_dflash2 import trained_looking

    config = vars(getattr(model, "language_model", model).args)
    v2 = DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    return trained_looking(create_random_draft(config, num_layers=2, block_size=BLOCK, mask_token_id=MASK_ID,
                                               dflash2=v2))


def quantized_with_vocabulary(draft: DFlashDraft) -> DFlashDraft:
    """The draft in 8 bits (kept quantized, as on Apple GPUs) with a draft vocabulary of every
    other token: greedy rows draft through a head of those rows."""
    from mlx_dflash.draft_io import quantize_draft

    draft.config.draft_vocab = list(range(0, draft.config.vocab_size, 2))
    quantize_draft(draft, 8)
    return draft


DRAFT_KINDS = {
    "dflash2": lambda model, draft: v2_draft(model),
    "dflash2-8bit-vocabulary": lambda model, draft: quantized_with_vocabulary(v2_draft(model)),
    "sliding-causal": lambda model, draft: sliding(draft, causal=True),
    "sliding-two-sided": lambda model, draft: sliding(draft, causal=False),
    "dflash2-sliding": lambda model, draft: sliding(v2_draft(model), causal=False),
}


@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_rows_draft_what_each_drafts_alone_and_keep_greedy_output(pair, kind):
    """DFlash2 drafts (also in 8 bits with a draft vocabulary) and drafts with sliding-window
    layers in a batch: every row's drafts (a DFlash2 draft's convolutions along the row's block
    and its selector's walk over the row's slots; a sliding window masked at the row's own
    positions) are those the single-sequence engine drafts after the same prompt; a sampled
    row's drafts (and a DFlash2 draft's q) are its draws with the same key; every greedy row's
    tokens are mlx-lm's, queued ahead too."""
    from mlx_dflash.sampling import SamplingParams

    model, v1, references = pair
    draft = DRAFT_KINDS[kind](model, v1)
    decoder = BatchDecoder(model, draft, BLOCK)
    sampled, seed = SamplingParams(temp=0.8), 11
    rows = [decoder.add(mx.array(p), n, sampled if i == 2 else None) for i, (p, n) in enumerate(zip(PROMPTS, LIMITS))]
    decoder.rows[rows[2].id].params = sampled.drawing(seed)  # (a known stream: the same draws alone)
    joined = [i for i, row in enumerate(rows) if not row.done]
    drafted, q = decoder._draft(mx.array([rows[i].first for i in joined], dtype=mx.uint32), BLOCK)
    for index, i in enumerate(joined):
        target, proposer = Target(model, draft.config.target_layer_ids), DFlashProposer(draft)
        proposer.start(target)
        prefill(target, proposer, mx.array(PROMPTS[i]), target.make_cache(), 512)
        first = mx.array([rows[i].first], dtype=mx.uint32)
        if i == 2 and draft.config.dflash2 is not None:
            alone, q_alone = proposer.sample(first, BLOCK - 1, sampled.temp, sampled.drawing(seed).key())
            # (a batch's products round apart from one row's: a few ulps of the larger probabilities)
            assert mx.allclose(q[index], q_alone, rtol=1e-4, atol=1e-6)
        elif i == 2:  # (a v1 draft's sampled row: its head's distribution, drawn with the same key)
            q_alone = sampled.probabilities(proposer.draft_logits(first, BLOCK - 1))
            alone = sample(q_alone, sampled.drawing(seed).key())
            assert mx.allclose(q[index], q_alone, rtol=1e-4, atol=1e-6)
        else:
            alone = proposer.propose(first, BLOCK - 1)
        assert drafted[index].tolist() == alone.tolist()
    assert batch_generate(model, PROMPTS, draft, LIMITS) == references
    queued = BatchDecoder(model, draft, BLOCK, options=QUEUED)  # (the GPUs' cycle: drafts after counts on the device)
    outputs = {row.id: list(row.tokens) for row in [queued.add(mx.array(p), n) for p, n in zip(PROMPTS, LIMITS)]}
    seen = queues(queued)
    while queued.rows:
        for row, tokens in queued.step().items():
            outputs[row] += tokens
    assert list(outputs.values()) == references
    assert any(seen) == queued.target.rolls_back_on_device


def test_rows_it_cannot_sample_are_refused():
    """Logits processors (even greedy ones), seeds and match acceptance run alone: a batch
    would drop or reorder what they read."""
    from mlx_lm.sample_utils import make_logits_processors

    from mlx_dflash.batch import batches
    from mlx_dflash.sampling import SamplingParams

    penalty = make_logits_processors(repetition_penalty=1.3)
    assert batches(None) and batches(SamplingParams()) and batches(SamplingParams(temp=0.7, top_p=0.9))
    assert batches(SamplingParams(seed=3))  # (greedy: a seed draws nothing)
    for params in (SamplingParams(logits_processors=penalty), SamplingParams(temp=0.7, logits_processors=penalty),
                   SamplingParams(temp=0.7, seed=3), SamplingParams(temp=0.7, accept="match")):
        assert not batches(params)


@pytest.mark.parametrize("queued", [False, True])
def test_a_rows_prompt_and_reply_serve_the_next_turn(pair, queued):
    """With a prefix cache, a row that leaves keeps its prompt and reply: the next turn (the
    prompt, the reply, a new message) prefills only the message, and its tokens are the cold ones;
    ``queued``: the row leaves with the next cycle queued and its slot left idle beside another
    row (GPUs), its state kept as of its own tokens, not the queued cycle's."""
    from mlx_dflash.prefix_cache import PrefixCache

    model, draft, references = pair
    decoder = BatchDecoder(model, draft, BLOCK, PrefixCache(1 << 30), options=QUEUED if queued else EngineOptions())
    first = decoder.add(mx.array(PROMPTS[2]), LIMITS[2])
    if queued:
        decoder.add(mx.array(PROMPTS[0]), LIMITS[2] + 4 * BLOCK)  # (still decoding when the first leaves)
    reply, queued_at_leave = list(first.tokens), None
    while first.id in decoder.rows:
        reply += decoder.step().get(first.id, [])
        queued_at_leave = decoder.queued is not None
    assert reply == references[2]
    from mlx_dflash.batch_cache import RowsKVCache

    kept_as_read = all(isinstance(c, RowsKVCache) for c in decoder.cache)  # (else read early: a hybrid's state)
    assert queued_at_leave == (queued and decoder.target.rolls_back_on_device and kept_as_read)
    turn = PROMPTS[2] + reply + list(range(60, 70))
    second = decoder.add(mx.array(turn), 12)
    if kept_as_read or not queued:  # (a hybrid's state read past its row's tokens is not kept: its prompt's is)
        assert second.reused_prompt_tokens == len(PROMPTS[2]) + len(reply) - 1
    tokens = list(second.tokens)
    while decoder.rows:
        tokens += decoder.step().get(second.id, [])
    assert tokens == greedy_reference(model, turn, 12)


def test_the_server_says_why_it_does_not_batch(pair, tiny_dir):
    from mlx_dflash.server import Served

    model, draft, _ = pair
    served = Served(model, None, draft, "m", 2048, 64)
    assert served.batch is not None and served.unbatched is None
    assert Served(model, None, draft, "m", 2048, 64, decode_concurrency=1).unbatched == "--decode-concurrency 1"
    assert "tree" in Served(model, None, draft, "m", 2048, 64, trees=True).unbatched
    assert Served(model, None, sliding(draft, causal=False), "m", 2048, 64).unbatched is None


def test_the_batch_warm_up_changes_no_token(pair):
    from mlx_dflash.prefix_cache import PrefixCache
    from mlx_dflash.warmup import warm_up_batch

    model, draft, references = pair
    decoder = BatchDecoder(model, draft, BLOCK, PrefixCache(1 << 30), BlockPolicy(BLOCK))
    warm_up_batch(decoder)
    assert not decoder.rows and decoder.prefix_cache.stats()["entries"] == 0 and decoder.policy.seconds
    outputs = {}
    for prompt, limit in zip(PROMPTS, LIMITS):
        row = decoder.add(mx.array(prompt), limit)
        outputs[row.id] = list(row.tokens)
    while decoder.rows:
        for row, tokens in decoder.step().items():
            outputs[row] += tokens
    assert list(outputs.values()) == references


def test_rows_of_their_own_lengths_are_written_masked_and_cut_each_by_its_own():
    """``RowsKVCache``: a block lands at each row's end, each row's mask is mlx-lm's causal one at
    its own offset (with a sliding window too), and a cut lowers each row's length alone."""
    from mlx_lm.models.base import create_causal_mask
    from mlx_lm.models.cache import KVCache

    from mlx_dflash.batch_cache import RowsKVCache

    rows = []
    for length in (3, 7):
        one = KVCache()
        one.update_and_fetch(*(mx.full((1, 2, length, 4), float(length)) for _ in range(2)))
        rows.append(RowsKVCache.joined(one))
    rows[0].extend(rows[1])
    cache = rows[0]
    for window in (None, 4):
        mask = cache.make_mask(3, window_size=window)
        for row, offset in enumerate((3, 7)):
            expected = create_causal_mask(3, offset, window_size=window)
            assert mx.array_equal(mask[row, 0, :, : offset + 3], expected).item()
            assert not mask[row, 0, :, offset + 3 :].any().item()
    keys, _ = cache.update_and_fetch(*(mx.full((2, 2, 3, 4), -1.0) for _ in range(2)))
    assert keys.shape[2] == 10 and cache.offset.tolist() == [6, 10]  # (read up to the longest row)
    assert keys[0, 0, :7, 0].tolist() == [3, 3, 3, -1, -1, -1, 0] and keys[1, 0, 6:10, 0].tolist() == [7, -1, -1, -1]
    cache.drop(mx.array([2, 0]))
    cache.settle(10)
    assert cache.offset.tolist() == [4, 10] and cache.bound == 10
    assert cache.row(0, 4).keys[0, 0, :4, 0].tolist() == [3, 3, 3, -1]


@pytest.mark.parametrize("stepwise", [True, False])
def test_hybrid_rows_rewind_each_to_its_own_prefix(tiny_dir, stepwise):
    """A hybrid target's recurrent layers rewind each row to its own accepted prefix, in both
    forms of the delta rule (stepwise: CUDA's default, here through mlx-lm's ops)."""
    path = make_tiny_target(tiny_dir / f"batch-rewind-{stepwise}", "qwen3_5")
    model, _ = load_tiny(path)
    draft = create_random_draft(json.loads((path / "config.json").read_text()), num_layers=2, block_size=BLOCK,
                                mask_token_id=MASK_ID)
    references = [greedy_reference(model, p, n) for p, n in zip(PROMPTS, LIMITS)]
    decoder = PlantedDrafts(model, draft, BLOCK, references={})
    for mixer in decoder.target._block_mixers.values():
        mixer.stepwise = stepwise
    assert decode_planted(decoder, references) == references


@pytest.mark.parametrize("compiled", [True, False])
def test_a_quantized_target_batched_equals_each_prompt_alone(tiny_dir, compiled):
    """A 4-bit target (and a 4-bit draft), compiled verifies and eager ones."""
    import mlx.nn as nn

    from mlx_dflash.draft_io import quantize_draft

    path = make_tiny_target(tiny_dir / "batch-quant-qwen3", "qwen3", hidden_size=128, head_dim=32)
    model, _ = load_tiny(path)
    nn.quantize(model, group_size=32, bits=4)
    draft = create_random_draft(json.loads((path / "config.json").read_text()), num_layers=1, block_size=BLOCK,
                                mask_token_id=MASK_ID)
    quantize_draft(draft, 4, 32)
    references = [greedy_reference(model, p, n) for p, n in zip(PROMPTS, LIMITS)]
    decoder = PlantedDrafts(model, draft, BLOCK, None, None, EngineOptions(queue_ahead=False, compile_blocks=compiled),
                            references={})
    assert decode_planted(decoder, references) == references
