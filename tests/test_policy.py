"""The adaptive block policy: plain decoding when drafts lose, full blocks when they win,
short blocks when a verify costs more with each token and the draft is weak; trees where their
measured tokens per second beat the chain's. (Policies without trees where a test is about chains.)"""

import itertools
import json
import time

import mlx.core as mx

import pytest
from tiny_models import MASK_ID, VOCAB_SIZE, load_tiny, make_tiny_target, tiny_pair

from mlx_dflash import EngineOptions, create_random_draft, generate, stream_generate
from mlx_dflash.batch import BatchDecoder
from mlx_dflash import policy as policy_module
from mlx_dflash.errors import DFlashError
from mlx_dflash.policy import (PROBE_MAX, PROBE_START, WARMUP_CYCLES, BlockPolicy, CycleClock, candidate_sizes,
                               check_tree_budget)
from mlx_dflash.replay import ReplayProposer


def drive(policy, acceptance_of, seconds_of, cycles):
    """The policy on a simulated pair; the sizes it chose, "f" for a plain step with a forecast
    (whose first ``acceptance_of(max_block) - 1`` guesses come true)."""
    chosen = []
    for _ in range(cycles):
        block = policy.choose()
        forecast = policy.wants_forecast
        chosen.append("f" if forecast else block)
        policy.record(block, min(acceptance_of(block), block), seconds_of(block), forecast)
        if forecast:
            policy.start_forecast([0] * (policy.max_block - 1))
        if policy.guess is not None:  # the token this step committed, against the next guess
            hits = acceptance_of(policy.max_block) - 1
            policy.observe([0 if policy.guess_checked < hits else 1])
    return chosen


def test_poor_draft_falls_back_to_plain_decoding_and_probes_rarely():
    policy = BlockPolicy(16, tree_budgets=())
    # acceptance 1 with a full block that costs twice a plain step: plain decoding wins
    chosen = drive(policy, lambda b: 1, lambda b: 2.0 if b == 16 else 1.0, 300)
    assert chosen[:WARMUP_CYCLES] == [16] * WARMUP_CYCLES
    later = chosen[100:]
    assert later.count("f") <= len(later) / PROBE_START  # probes (forecasts beside plain steps) back off
    assert later.count(1) > 0.9 * len(later)
    assert set(chosen) == {1, "f", 16}  # 2, 4 and 8 cannot beat plain decoding: never tried


def run_text(policy, runs, cost, forecast_cost):
    """The policy over a text whose cycles' runs of drafted tokens the target would accept are
    ``runs``; ``cost(cycle, block, previous_block)``: a cycle's seconds. The sizes chosen."""
    chosen, previous = [], 16
    for cycle, run in enumerate(runs):
        block = policy.choose()
        forecast = policy.wants_forecast
        seconds = cost(cycle, block, previous) + forecast_cost * forecast
        policy.record(block, min(run, block - 1) + 1, seconds, forecast)
        if forecast:
            policy.start_forecast([0] * 15)
        if policy.guess is not None:
            policy.observe([0 if policy.guess_checked < run else 1])
        chosen.append(block)
        previous = block
    return chosen


def test_a_switchs_cost_is_not_charged_to_the_size_switched_to():
    """On a GPU the plain step queued behind a block costs ~2 steady ones (it takes the masked
    path); charged to plain decoding it made plain decoding look as dear as blocks, and a text
    that turned unpredictable after a good start stayed on blocks. Only a cycle after one of its
    own size is timed."""
    policy = BlockPolicy(16, tree_budgets=())
    # drafted tokens accepted: a good start, then a poor draft (0.64 a block) with a few longer runs
    runs = [4] * 17 + [0, 0, 0, 1, 0, 0, 2, 0, 0, 0, 5, 0, 0, 1] * 40
    def cost(cycle: int, block: int, previous: int) -> float:
        return 2.7 if block > 1 else 2.0 if previous > 1 else 1.0

    chosen = run_text(policy, runs[:500], cost, 0.6)
    assert policy.seconds[1] == 1.0 and policy.seconds[16] == 2.7
    assert chosen[200:].count(1) > 0.9 * 300, chosen[200:].count(1)


def run_stale_plain_cost_text(policy):
    """Past a text's end (on a GPU): plain steps timed early in a text cost more than later
    ones, and a policy that kept the early cost ran 16-token blocks at acceptance ~1.5, half
    mlx-lm's speed. The sizes chosen in such a text."""
    runs = [12] * 8 + [0, 0, 1, 0, 2, 0, 0, 1] * 60  # drafted tokens accepted: a good start, then poor

    def cost(cycle: int, block: int, previous: int) -> float:
        plain = 7.7 if cycle < 12 else 5.3  # the text's first plain steps are dear
        return 10.8 if block > 1 else 10.0 if previous > 1 else plain

    return run_text(policy, runs, cost, 3.0)


def test_a_stale_plain_cost_is_timed_again():
    """While blocks win by less than RETIME_MARGIN, a probe times plain decoding again."""
    chosen = run_stale_plain_cost_text(BlockPolicy(16, tree_budgets=()))
    assert chosen[:12].count(1) >= 2  # plain decoding was timed early, at its dear cost
    assert chosen[-200:].count(1) > 0.9 * 200, chosen[-200:].count(1)


def test_a_stale_plain_cost_is_timed_again_after_a_text_plain_decoding_won():
    """A shared policy keeps the probes' back-off after a text where plain decoding won (up to
    PROBE_MAX cycles between probes); re-times have their own, so they still come."""
    policy = BlockPolicy(16, tree_budgets=())
    useless = drive(policy, lambda b: 1, lambda b: 2.0 if b > 1 else 1.0, 600)
    assert useless[-100:].count(1) > 95 and policy.probes.every == PROBE_MAX
    policy.start_text()
    chosen = run_stale_plain_cost_text(policy)
    assert chosen[-200:].count(1) > 0.9 * 200, chosen[-200:].count(1)


def test_a_text_that_turns_poor_falls_back_after_a_long_good_start():
    """Acceptance statistics fade (SLOT_DECAY a cycle): a text whose answer ends after a long
    predictable stretch (`bench --no-eos`) otherwise kept blocks for as long as
    its good start outweighed the poor cycles since."""
    policy = BlockPolicy(16, tree_budgets=())
    drive(policy, lambda b: 12, lambda b: 2.0 if b > 1 else 1.0, 100)
    poor = itertools.cycle([1, 1, 2, 1, 3, 1, 1, 2])  # 1.5 tokens a block: plain decoding wins
    chosen = drive(policy, lambda b: min(next(poor), b), lambda b: 2.0 if b > 1 else 1.0, 300)
    assert chosen[-100:].count(1) > 85, chosen[-100:].count(1)


def test_a_runs_first_cycle_resets_a_cost_only_downwards():
    """The first steady cycle of a size's run replaces its cost when cheaper (the cost was timed
    when steps were dearer) and only moves it a little when dearer (a one-off: a new trace)."""
    policy = BlockPolicy(16, tree_budgets=())
    for block, seconds in [(1, 9.0), (1, 2.0), (1, 2.0)]:  # a plain run: 2.0 after the switch
        policy.record(block, 1, seconds)
    assert policy.seconds[1] == 2.0
    for block, seconds in [(16, 5.0), (16, 5.0), (1, 9.0), (1, 10.0)]:  # a dear first steady step
        policy.record(block, 1, seconds)
    assert policy.seconds[1] == 0.8 * 2.0 + 0.2 * (policy_module.SPIKE_CAP * 2.0)  # (a spike counts as 1.5x at most)
    for block, seconds in [(16, 5.0), (1, 9.0), (1, 1.0), (1, 2.0)]:  # a cheap one: believed at once
        policy.record(block, 1, seconds)
    assert policy.seconds[1] == 0.8 * 1.0 + 0.2 * (policy_module.SPIKE_CAP * 1.0)


def test_a_size_timed_in_a_stall_is_timed_again_by_its_probes():
    """A probe runs two cycles and times the second: a full block whose one timed cycle caught
    a stall (a new compiled shape) would otherwise look dear for good, its probes never timed."""
    policy = BlockPolicy(16, tree_budgets=())
    costs = {1: 6.0, 2: 12.0, 4: 13.0, 8: 15.8, 16: 14.4}  # a GPU: 16 no dearer than 8
    stalled = iter([True])
    def seconds_of(block: int) -> float:
        stall = block == 16 and policy.previous_block == 16 and next(stalled, False)
        return costs[block] * (3.0 if stall else 1.0)

    chosen = drive(policy, lambda b: min(6, b), seconds_of, 300)
    assert policy.seconds[16] == pytest.approx(14.4) and chosen[-100:] == [16] * 100


def test_stalls_do_not_make_plain_decoding_look_dear():
    """Plain steps of 5 ms with a stall of 25-50 ms every few steps (a GPU's hiccups) still cost
    about 5 ms to the policy: useless 16-blocks at 8.6 ms never look faster."""
    policy = BlockPolicy(16, tree_budgets=())
    stalls = iter([0.05 if i % 7 == 3 else 0.025 if i % 11 == 5 else 0.005 for i in range(10_000)])
    chosen = drive(policy, lambda b: 1, lambda b: next(stalls) if b == 1 else 0.0086, 600)
    assert policy.seconds[1] < 0.0086 and chosen[100:].count(1) > 0.9 * 500


def test_good_draft_is_not_retimed():
    """A draft that wins by far runs no re-time probes (they cost plain steps)."""
    policy = BlockPolicy(16, tree_budgets=())
    chosen = drive(policy, lambda b: 12, lambda b: 2.0 if b > 1 else 1.0, 200)
    assert chosen[20:].count(16) == 180


def test_policy_climbs_back_when_the_text_becomes_predictable():
    policy = BlockPolicy(16, tree_budgets=())
    useless = drive(policy, lambda b: 1, lambda b: 1.0 + 0.02 * b, 150)
    assert useless[-50:].count(1) > 45
    perfect = drive(policy, lambda b: b, lambda b: 1.0 + 0.02 * b, 300)
    assert perfect[-50:] == [16] * 50


def test_good_draft_keeps_full_blocks():
    policy = BlockPolicy(16, tree_budgets=())  # verify cost flat in the block size (a GPU): full blocks win
    chosen = drive(policy, lambda b: 12, lambda b: 1.0, 100)
    assert chosen[20:].count(16) == 80


def test_weak_draft_with_growing_verify_cost_picks_short_blocks():
    policy = BlockPolicy(16, tree_budgets=())  # cost grows with the block (a CPU); 3 tokens per full block
    chosen = drive(policy, lambda b: 3, lambda b: 1.0 + 0.1 * (b - 1), 200)
    # rates E[min(L, b)] / cost(b): 1 -> 1.0, 2 -> 1.82, 4 -> 2.31, 8 -> 1.76, 16 -> 1.2
    assert chosen[50:].count(4) > 0.9 * 150
    assert abs(policy.expected_tokens(4) - 3.0) < 1e-9 and abs(policy.expected_tokens(2) - 2.0) < 1e-9


def test_slot_statistics_use_short_blocks_too(monkeypatch):
    policy = BlockPolicy(16, tree_budgets=(), slot_decay=1.0)  # (what is counted, without the fading)
    for _ in range(10):
        policy.record(4, 4, 0.1)  # all 3 drafted slots accepted: slot 4 never checked
        policy.record(4, 2, 0.1)  # slot 1 accepted, slot 2 rejected
    assert policy.slot_checked[1:5] == [20, 20, 10, 0]
    assert policy.slot_accepted[1:5] == [20, 10, 10, 0]
    assert abs(policy.expected_tokens(4) - (1 + 1 + 0.5 + 0.5)) < 1e-9


def test_an_unchecked_slot_is_as_likely_as_the_deepest_slot_checked():
    """Slot 1 accepted once in three, slots 2.. never checked (a short block's, a forecast's first
    hit): a full block expects a geometric run, not 15 certain slots, so where a verify costs more
    with each token (a CPU) plain decoding wins."""
    policy = BlockPolicy(16, tree_budgets=(), slot_decay=1.0)
    assert policy.expected_tokens(16) == 16  # nothing checked yet: optimistic
    policy.record(2, 2, 1.43)  # slot 1 accepted, slot 2 not checked
    policy.record(16, 1, 3.13)
    policy.record(16, 1, 3.13)
    assert policy.slot_checked[1:3] == [3, 0]
    assert abs(policy.expected_tokens(16) - sum(3.0 ** -k for k in range(16))) < 1e-9
    policy.seconds = {1: 1.0, 2: 1.43, 4: 1.8, 8: 2.27, 16: 3.13}
    policy.chosen = 5
    assert policy.choose() == 1  # (15 certain slots: 6 tokens for 3.13, a full block)


def test_a_shared_policy_keeps_its_costs_and_starts_each_text_afresh():
    policy = BlockPolicy(16, tree_budgets=())
    drive(policy, lambda b: 1, lambda b: 2.0 if b == 16 else 1.0, 100)  # useless draft: plain wins
    costs = dict(policy.seconds)
    policy.start_text()
    assert policy.seconds == costs and policy.slot_checked == [0] * 16 and policy.cycles == 0
    # the next text's draft is perfect: a forecast, then full blocks as soon as its first guess
    # comes true (a fresh policy would time plain decoding first)
    assert drive(policy, lambda b: b, lambda b: 2.0 if b == 16 else 1.0, 10) == ["f"] + [16] * 9
    assert drive(BlockPolicy(16, tree_budgets=()), lambda b: b, lambda b: 2.0 if b == 16 else 1.0, 10)[WARMUP_CYCLES] == 1
    policy.probes.every = 8 * PROBE_START
    policy.start_text()  # after a text where blocks won: a full block first and probes as often as at first
    assert policy.probes.every == PROBE_START
    assert drive(policy, lambda b: b, lambda b: 2.0 if b == 16 else 1.0, 3) == [16] * 3


def test_a_shared_policy_starts_a_text_with_a_forecast_and_keeps_its_probe_back_off():
    """After a text where plain decoding won, a new text's acceptance comes from a forecast (a
    draft pass) instead of a verified block, and probes that kept losing on earlier texts stay
    rare: a useless draft costs one draft pass per text."""
    useless, cost = (lambda b: 1), (lambda b: 2.0 if b == 16 else 1.0)
    policy = BlockPolicy(16, tree_budgets=())
    drive(policy, useless, cost, 300)
    assert policy.probes.every > PROBE_START
    policy.start_text()
    shared = drive(policy, useless, cost, 100)
    fresh = drive(BlockPolicy(16, tree_budgets=()), useless, cost, 100)
    assert shared[:2] == ["f", 1] and shared.count("f") == 1 and 16 not in shared
    assert fresh[:WARMUP_CYCLES] == [16] * WARMUP_CYCLES and fresh.count("f") > 1


def test_a_forecast_checks_its_guesses_until_the_first_miss():
    policy = BlockPolicy(16, tree_budgets=())
    policy.seconds = {1: 1.0, 16: 40.0}
    policy.cycles = 1  # a text where plain decoding won
    policy.start_text()
    assert policy.choose() == 1 and policy.wants_forecast
    assert policy.choose() == 1 and not policy.wants_forecast  # one forecast at a time
    policy.record(1, 1, 9.0, forecast=True)
    assert policy.samples[1] == 1 and policy.seconds[1] == 1.0  # a forecast's step is not timed
    policy.start_forecast([5, 6, 7, 8])
    policy.observe([5])
    policy.observe([6, 9, 8])  # a block's tokens: checked in turn, to the first miss
    assert policy.slot_checked[1:5] == [1, 1, 1, 0] and policy.slot_accepted[1:5] == [1, 1, 0, 0]
    assert policy.guess is None and not policy.forecasting


def test_candidate_sizes():
    assert candidate_sizes(16) == [1, 2, 4, 8, 16]
    assert candidate_sizes(10) == [1, 2, 4, 8, 10]
    assert candidate_sizes(1) == [1]


def test_adaptive_output_is_unchanged(tiny_dir):
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "policy-qwen3", "qwen3", "adaptive", 120)
    shared = BlockPolicy(16, tree_budgets=())  # one policy over several generations, as in the server
    for schedule in ([0], [None], [None, 0, 5]):  # useless, perfect and mixed drafts
        for adaptive in (True, shared):
            proposer = ReplayProposer(prompt + reference, 16, schedule, VOCAB_SIZE)
            result = generate(model, tokenizer, prompt, proposer, max_tokens=100, adaptive=adaptive)
            assert result.tokens == reference[:100]
    # one policy timed them all: the useless draft's plain steps and the perfect draft's full blocks
    assert shared.samples.get(1, 0) > 0 and shared.samples.get(16, 0) > 0
    with pytest.raises(DFlashError, match="blocks of up to 16, not 8"):
        generate(model, tokenizer, prompt, proposer, max_tokens=10, block_size=8, adaptive=shared)


def test_the_callers_time_with_the_tokens_is_not_a_cycles_cost(tiny_dir):
    """A consumer that keeps each cycle's tokens a while (a server running its batch's cycles
    between a lone generation's) does not make the policy believe that wait is what a size
    costs; a short hand-over is still timed, and both ways give the same tokens."""
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "policy-away", "qwen3", "away", 40)
    beliefs = {}
    for away in (0.0, 0.25):
        policy = BlockPolicy(16, tree_budgets=())
        proposer = ReplayProposer(prompt + reference, 16, [None, 0, 5], VOCAB_SIZE)
        tokens = []
        for response in stream_generate(model, tokenizer, prompt, proposer, max_tokens=40, adaptive=policy):
            tokens += response.tokens
            time.sleep(away)
        assert tokens == reference[:40]
        beliefs[away] = policy
    assert beliefs[0.0].seconds and beliefs[0.25].samples  # (cycles of known sizes ran both ways)
    assert not beliefs[0.25].seconds  # (every window was mostly the consumer's: nothing timed)
    clock = CycleClock()
    time.sleep(0.02)
    clock.pause()
    time.sleep(0.005)
    clock.resume()
    assert clock.cycle_seconds(0.0) >= 0.025  # (a short hand-over: timed, with it)


def test_the_time_between_a_batchs_steps_is_not_a_cycles_cost(tiny_dir):
    """The same for the batch decoder: a server's work between two of its steps (a lone
    generation's cycles) is not what the batch's cycles cost."""
    path = make_tiny_target(tiny_dir / "policy-batch-away", "qwen3")
    model, _ = load_tiny(path)
    config = json.loads((path / "config.json").read_text())
    draft = create_random_draft(config, num_layers=1, block_size=8, mask_token_id=MASK_ID)
    policy = BlockPolicy(8)
    decoder = BatchDecoder(model, draft, 8, policy=policy)
    for prompt in ([40, 41, 42], [50, 51, 52, 53]):
        decoder.add(mx.array(prompt), 16)
    while decoder.rows:
        decoder.step()
        time.sleep(0.1)
    assert policy.samples and not policy.seconds


def test_short_generations_choose_whole_sizes_that_fit(tiny_dir):
    """With fewer tokens wanted than a block, the policy picks candidate sizes that fit, so
    each block's cost is learned (blocks cut short never were: the policy kept drafting)."""
    policy = BlockPolicy(16, tree_budgets=())
    chosen = []
    for wanted in range(15, 0, -1):  # a 16-token generation: one token per cycle (useless draft)
        block = policy.choose(limit=wanted)
        assert block in candidate_sizes(16) and block <= wanted
        chosen.append(block)
        policy.record(block, 1, 0.01 * (1 + block))
    assert chosen[:WARMUP_CYCLES] == [8] * WARMUP_CYCLES and chosen[-8:] == [1] * 8
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "policy-short", "qwen3", "short", 40)
    for max_tokens in range(1, 20):
        proposer = ReplayProposer(prompt + reference, 16, [2], VOCAB_SIZE)
        result = generate(model, tokenizer, prompt, proposer, max_tokens=max_tokens, adaptive=True)
        assert result.tokens == reference[:max_tokens]


def test_short_blocks_check_the_slot_after_them(tiny_dir, monkeypatch):
    """A draft proposes one token past a short block; when the block is wholly accepted, that
    token is checked against the block's bonus token (the slot after the block)."""
    policy = BlockPolicy(16, tree_budgets=(), slot_decay=1.0)  # (what is counted, without the fading)
    policy.record(4, 4, 1.0)
    policy.start_forecast([7], first_slot=4)
    policy.observe([7])
    assert policy.slot_checked[1:6] == [1, 1, 1, 1, 0] and policy.slot_accepted[4] == 1 and policy.guess is None
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "policy-peek", "qwen3", "peek", 40)
    policy = BlockPolicy(16, tree_budgets=(), slot_decay=1.0)
    policy.seconds = {1: 1.0, 2: 100.0, 4: 1.0, 8: 100.0, 16: 100.0}  # 4-token blocks win
    proposer = ReplayProposer(prompt + reference, 16, [None], VOCAB_SIZE)  # a perfect draft
    result = generate(model, tokenizer, prompt, proposer, max_tokens=33, adaptive=policy)
    assert result.tokens == reference[:33] and result.acceptance_lengths == [16] + [4] * 4  # (a warm-up block)
    assert policy.slot_checked[4] == policy.slot_accepted[4] == 1 + 4  # each whole 4-block: one check past it
    assert policy.slot_checked[5] == 1
    # blocks of up to 8 from a 16-token draft: guesses stay within the policy's 8 slots
    policy = BlockPolicy(8, tree_budgets=(), slot_decay=1.0)
    policy.seconds = {1: 1.0, 2: 100.0, 4: 1.0, 8: 100.0}
    result = generate(model, tokenizer, prompt, proposer, max_tokens=33, block_size=8, adaptive=policy)
    assert result.tokens == reference[:33] and policy.slot_checked[4] > 0


def test_a_forecast_in_generation_measures_what_a_block_would_accept(tiny_dir, monkeypatch):
    """The forecast drafted beside a plain step records the acceptance a block would have had
    (the replayed guesses are right for 5 slots, then wrong); the output stays mlx-lm's."""
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "policy-forecast", "qwen3", "forecast", 40)
    policy = BlockPolicy(16, tree_budgets=(), slot_decay=1.0)  # (what is counted, without the fading)
    policy.seconds = {size: 1.0 if size == 1 else 100.0 for size in policy.sizes}  # plain decoding wins
    policy.probes.every = PROBE_MAX  # only the text's first forecast
    policy.cycles = 1  # as after a text where plain decoding won (generate starts the text)
    proposer = ReplayProposer(prompt + reference, 16, [5], VOCAB_SIZE)
    result = generate(model, tokenizer, prompt, proposer, max_tokens=30, adaptive=policy)
    assert result.tokens == reference[:30]
    assert result.acceptance_lengths == [1] * 29  # plain steps only
    assert policy.slot_checked[1:8] == [1] * 6 + [0] and policy.slot_accepted[1:7] == [1] * 5 + [0]
    # blocks of up to 4 from a 16-token draft: the forecast guesses the policy's 3 slots only
    policy = BlockPolicy(4, tree_budgets=(), slot_decay=1.0)
    policy.seconds, policy.probes.every, policy.cycles = {1: 1.0, 2: 100.0, 4: 100.0}, PROBE_MAX, 1
    proposer = ReplayProposer(prompt + reference, 16, [None], VOCAB_SIZE)
    result = generate(model, tokenizer, prompt, proposer, max_tokens=30, block_size=4, adaptive=policy)
    assert result.tokens == reference[:30] and policy.slot_checked[1:4] == [1, 1, 1]


def test_queued_cycles_charge_each_size_its_own_launch(tiny_dir, monkeypatch):
    """With the next cycle queued before this one's count is read (GPUs), the window between
    two syncs holds the next cycle's launch; each size must still be charged its own launch
    (a plain step followed by a block was charged the block's). A fake clock advances only
    while the target runs: n units for n tokens, so a size's cost is exactly its size."""
    import types

    from mlx_dflash import engine
    from mlx_dflash.target import Target

    clock = [0.0]
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock[0])
    monkeypatch.setattr(engine, "time", fake_time)
    monkeypatch.setattr(policy_module, "time", fake_time)

    class CountedTarget(Target):
        def __call__(self, tokens, cache, **kwargs):
            clock[0] += tokens.shape[1]
            return super().__call__(tokens, cache, **kwargs)

    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "policy-queued", "qwen3", "queued", 80)
    policy = BlockPolicy(16, tree_budgets=())
    policy.start_text()
    proposer = ReplayProposer(prompt + reference, 16, [0, 0, 3, None], VOCAB_SIZE)
    target = CountedTarget(model, proposer.layer_ids, EngineOptions(queue_ahead=True, pad_reads=True))
    cycles = engine.decode_cycles(target, proposer, mx.array(prompt), 80, 16, policy=policy)
    assert [t for cycle in cycles for t in cycle.tokens] == reference[:80]
    assert {1, 16} <= set(policy.seconds)  # plain steps and blocks, mixed
    assert all(seconds == size for size, seconds in policy.seconds.items()), policy.seconds


def drive_trees(policy, chain_tokens, tree_tokens, cost, cycles):
    """``drive`` with trees: a full chain block commits ``chain_tokens``, a tree of size s
    ``tree_tokens(s)``; ``cost(size)``: a cycle's seconds."""
    chosen = []
    for _ in range(cycles):
        size = policy.choose()
        tokens = tree_tokens(size) if size > policy.max_block else min(chain_tokens, size)
        policy.record(size, tokens, cost(size), policy.wants_forecast)
        chosen.append(size)
    return chosen


def test_trees_win_where_their_tokens_per_second_do():
    policy = BlockPolicy(16, tree_budgets=(32, 64))
    assert policy.sizes[-2:] == [33, 65]
    # chain: 6 tokens / 1.0 s; tree 33: 9 / 1.1; tree 65: 10 / 1.6
    chosen = drive_trees(policy, 6, lambda s: 9 if s == 33 else 10, lambda s: {33: 1.1, 65: 1.6}.get(s, 1.0), 200)
    assert chosen[50:].count(33) > 0.9 * 150
    assert abs(policy.expected_tokens(33) - 9) < 1e-9


def test_dear_trees_are_probed_rarely():
    policy = BlockPolicy(16, tree_budgets=(32,))
    chosen = drive_trees(policy, 6, lambda s: 7, lambda s: 2.0 if s == 33 else 1.0, 300)
    assert chosen[100:].count(16) > 0.95 * 200 and 0 < chosen.count(33) < 20


def test_tree_probes_back_off_across_texts():
    """Whether trees pay is the machine's and the pair's: where they lose, a policy serving many
    short texts probes them less and less often, not once in every text."""
    policy = BlockPolicy(16, tree_budgets=(32,))
    trees = []
    for _ in range(40):
        policy.start_text()
        chosen = drive_trees(policy, 6, lambda s: 7, lambda s: 2.0 if s == 33 else 1.0, 30)
        trees.append(chosen.count(33))
    assert sum(trees[:3]) >= 2 and sum(trees[20:]) <= 6, trees
    assert policy.tree_probes.every == PROBE_MAX


def test_a_text_that_turns_predictable_leaves_trees_for_chains():
    """Trees win on a hard stretch (7 tokens a 1.5 s tree, against 4 a 1 s chain); then the text
    loops: a chain commits its whole block (16) and a tree only 13. Tree cycles say nothing of
    the chain's acceptance: without probes of the full block the policy stayed on trees."""
    policy = BlockPolicy(16, tree_budgets=(64,))
    cost = lambda s: 1.5 if s == 65 else 1.0  # noqa: E731
    hard = drive_trees(policy, 4, lambda s: 7, cost, 200)
    looping = drive_trees(policy, 16, lambda s: 13, cost, 200)
    assert hard[100:].count(65) > 90 and looping[100:].count(16) > 90, (hard[100:], looping[100:])


def test_no_trees_where_they_cannot_run_or_do_not_fit():
    policy = BlockPolicy(16, tree_budgets=(32,))
    for _ in range(50):
        size = policy.choose(trees=False)
        assert size <= 16
        policy.record(size, min(size, 6), 1.0)
    policy.record(33, 12, 0.5)
    policy.record(33, 12, 0.5)  # (timed: trees now win by far)
    assert policy.choose(limit=10) <= 10 and policy.choose(limit=40) == 33


def test_a_policys_tree_budget_below_the_block_is_refused():
    """A policy's trees are sizes past the block; fixed blocks take trees of any budget."""
    with pytest.raises(DFlashError, match="tree budgets must be in 16..1024 .* --no-adaptive"):
        BlockPolicy(16, tree_budgets=(8,))
    check_tree_budget(4, 16, fixed=True)
    for fixed in (True, False):  # (a budget no setting takes: the range alone)
        with pytest.raises(DFlashError, match="^a tree budget must be in 1..1024, got 0$"):
            check_tree_budget(0, 16, fixed=fixed)


def test_costs_are_kept_apart_per_key():
    """A batch keys its costs by row count: each key's sizes are timed on their own, and a key
    met again gets its own back; acceptance is shared."""
    policy = BlockPolicy(4)
    policy.use_costs(2)
    for block, seconds in ((1, 0.01), (1, 0.01), (4, 0.02), (4, 0.02)):
        policy.record(block, 1, seconds)
    two = dict(policy.seconds)
    assert two == {1: 0.01, 4: 0.02}
    policy.use_costs(16)
    assert policy.seconds == {}  # (timed afresh: 16 rows cost another multiple of a step)
    for block, seconds in ((1, 0.02), (1, 0.02)):
        policy.record(block, 1, seconds)
    assert policy.seconds == {1: 0.02}
    policy.use_costs(2)
    assert policy.seconds == two and policy.cost_tables[16][0] == {1: 0.02}


def test_a_batch_expects_its_rows_mean_acceptance():
    """One cost buys every row's tokens: the acceptance a batch's policy learns is its rows'
    mean, not its first row's. Blocks of b tokens cost 1 + 0.2 (b - 1) plain steps (a CPU).
    The first of 16 rows loops (accepts every draft), the others accept none: plain decoding
    wins (16 tokens a step; (16 + 15) / 4 a step's worth with full blocks). The first row's
    drafts all fail and the other 15 rows accept everything: full blocks win."""
    for rows, settled in (([16] + [1] * 15, 1), ([1] + [16] * 15, 16)):
        policy = BlockPolicy(16, tree_budgets=())
        chosen = []
        for _ in range(300):
            block = policy.choose()
            forecast = policy.wants_forecast
            seconds = 1.0 + 0.2 * (block - 1)
            if forecast:  # (a plain step's forecast is the first row's, as BatchDecoder's)
                policy.record_cycle(1, [0], seconds, [0] * 15 if rows[0] == 16 else [1] * 15)
            else:
                policy.record_rows(block, [min(a, block) for a in rows], seconds)
            chosen.append(block)
        assert chosen[150:].count(settled) > 120, (rows[0], chosen[150:])


def test_a_new_row_count_drops_a_forecast_under_way():
    """A batch's forecast still being checked when rows join (a fresh cost table, nothing timed
    in it) is dropped, not judged against no costs (that raised ValueError in the server)."""
    policy = BlockPolicy(16, tree_budgets=())
    policy.use_costs(2)
    for _ in range(300):  # useless drafts: plain decoding wins and probes come as forecasts
        block = policy.choose()
        if policy.wants_forecast:
            policy.record_cycle(1, [0], 1.0, [0] * 15)  # (its first guess right: still under way)
            break
        policy.record_rows(block, [1, 1], 2.0 if block > 1 else 1.0)
    assert policy.forecasting
    policy.use_costs(4)
    assert not policy.forecasting and policy.choose() == 16  # (the new count's warm-up: its largest block)
    policy.record_rows(16, [1] * 4, 2.0)
