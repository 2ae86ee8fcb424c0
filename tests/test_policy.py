"""The adaptive block policy: plain decoding when drafts lose, full blocks when they win,
short blocks when a verify costs more with each token and the draft is weak."""

import pytest
from tiny_models import VOCAB_SIZE, tiny_pair

from mlx_dflash import generate
from mlx_dflash.errors import DFlashError
from mlx_dflash.policy import PROBE_START, WARMUP_CYCLES, BlockPolicy, candidate_sizes
from mlx_dflash.replay import ReplayProposer


def drive(policy, acceptance_of, seconds_of, cycles):
    chosen = []
    for _ in range(cycles):
        block = policy.choose()
        chosen.append(block)
        policy.record(block, min(acceptance_of(block), block), seconds_of(block))
    return chosen


def test_poor_draft_falls_back_to_plain_decoding_and_probes_rarely():
    policy = BlockPolicy(16)
    # acceptance 1 with a full block that costs twice a plain step: plain decoding wins
    chosen = drive(policy, lambda b: 1, lambda b: 2.0 if b == 16 else 1.0, 300)
    assert chosen[:WARMUP_CYCLES] == [16] * WARMUP_CYCLES
    later = chosen[100:]
    assert later.count(2) <= len(later) / PROBE_START  # probes (one size up) back off
    assert later.count(1) > 0.9 * len(later)
    assert set(chosen) == {1, 2, 16}  # 4 and 8 cannot beat plain decoding: never tried


def test_policy_climbs_back_when_the_text_becomes_predictable():
    policy = BlockPolicy(16)
    useless = drive(policy, lambda b: 1, lambda b: 1.0 + 0.02 * b, 150)
    assert useless[-50:].count(1) > 45
    perfect = drive(policy, lambda b: b, lambda b: 1.0 + 0.02 * b, 300)
    assert perfect[-50:] == [16] * 50


def test_good_draft_keeps_full_blocks():
    policy = BlockPolicy(16)  # verify cost flat in the block size (a GPU): full blocks win
    chosen = drive(policy, lambda b: 12, lambda b: 1.0, 100)
    assert chosen[20:].count(16) == 80


def test_weak_draft_with_growing_verify_cost_picks_short_blocks():
    policy = BlockPolicy(16)  # cost grows with the block (a CPU); 3 tokens per full block
    chosen = drive(policy, lambda b: 3, lambda b: 1.0 + 0.1 * (b - 1), 200)
    # rates E[min(L, b)] / cost(b): 1 -> 1.0, 2 -> 1.82, 4 -> 2.31, 8 -> 1.76, 16 -> 1.2
    assert chosen[50:].count(4) > 0.9 * 150
    assert abs(policy.expected_tokens(4) - 3.0) < 1e-9 and abs(policy.expected_tokens(2) - 2.0) < 1e-9


def test_slot_statistics_use_short_blocks_too():
    policy = BlockPolicy(16)
    for _ in range(10):
        policy.record(4, 4, 0.1)  # all 3 drafted slots accepted: slot 4 never checked
        policy.record(4, 2, 0.1)  # slot 1 accepted, slot 2 rejected
    assert policy.slot_checked[1:5] == [20, 20, 10, 0]
    assert policy.slot_accepted[1:5] == [20, 10, 10, 0]
    assert abs(policy.expected_tokens(4) - (1 + 1 + 0.5 + 0.5)) < 1e-9


def test_a_shared_policy_keeps_its_costs_and_starts_each_text_afresh():
    policy = BlockPolicy(16)
    drive(policy, lambda b: 1, lambda b: 2.0 if b == 16 else 1.0, 100)  # useless draft: plain wins
    costs = dict(policy.seconds)
    policy.start_text()
    assert policy.seconds == costs and policy.slot_checked == [0] * 16 and policy.cycles == 0
    # the next text's draft is perfect: after the warm-up, full blocks at once (a fresh policy
    # would time plain decoding first)
    assert drive(policy, lambda b: b, lambda b: 2.0 if b == 16 else 1.0, 10) == [16] * 10
    assert drive(BlockPolicy(16), lambda b: b, lambda b: 2.0 if b == 16 else 1.0, 10)[WARMUP_CYCLES] == 1


def test_a_shared_policy_warms_up_with_one_block_and_keeps_its_probe_back_off():
    """A text's warm-up block is timed when the policy knows that size already (one block, not
    two), and probes that kept losing on earlier texts stay rare (a useless draft costs less)."""
    useless, cost = (lambda b: 1), (lambda b: 2.0 if b == 16 else 1.0)
    policy = BlockPolicy(16)
    drive(policy, useless, cost, 300)
    assert policy.probe_every > PROBE_START
    policy.start_text()
    shared = drive(policy, useless, cost, 100)
    fresh = drive(BlockPolicy(16), useless, cost, 100)
    assert shared[:2] == [16, 1] and fresh[:WARMUP_CYCLES] == [16] * WARMUP_CYCLES
    assert shared.count(2) == 0 < fresh.count(2)


def test_candidate_sizes():
    assert candidate_sizes(16) == [1, 2, 4, 8, 16]
    assert candidate_sizes(10) == [1, 2, 4, 8, 10]
    assert candidate_sizes(1) == [1]


def test_adaptive_output_is_unchanged(tiny_dir):
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "policy-qwen3", "qwen3", "adaptive", 120)
    shared = BlockPolicy(16)  # one policy over several generations, as in the server
    for schedule in ([0], [None], [None, 0, 5]):  # useless, perfect and mixed drafts
        for adaptive in (True, shared):
            proposer = ReplayProposer(prompt + reference, 16, schedule, VOCAB_SIZE)
            result = generate(model, tokenizer, prompt, proposer, max_tokens=100, adaptive=adaptive)
            assert result.tokens == reference[:100]
    assert shared.samples[16] > 3  # it was used by all three generations
    with pytest.raises(DFlashError, match="blocks of up to 16, not 8"):
        generate(model, tokenizer, prompt, proposer, max_tokens=10, block_size=8, adaptive=shared)


def test_short_generations_choose_whole_sizes_that_fit(tiny_dir):
    """With fewer tokens wanted than a block, the policy picks candidate sizes that fit, so
    each block's cost is learned (blocks cut short never were: the policy kept drafting)."""
    policy = BlockPolicy(16)
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
