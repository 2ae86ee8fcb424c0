"""The adaptive block policy: plain decoding when drafts lose, full blocks when they win."""

from tiny_models import VOCAB_SIZE, tiny_pair

from mlx_dflash import generate
from mlx_dflash.policy import PROBE_START, WARMUP_CYCLES, BlockPolicy
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
    assert later.count(16) <= len(later) / PROBE_START  # probes back off
    assert later.count(1) > 0.9 * len(later)


def test_good_draft_keeps_full_blocks():
    policy = BlockPolicy(16)
    chosen = drive(policy, lambda b: 8, lambda b: 2.0 if b == 16 else 1.0, 100)
    assert chosen[20:].count(16) == 80


def test_adaptive_output_is_unchanged(tiny_dir):
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "policy-qwen3", "qwen3", "adaptive", 120)
    for schedule in ([0], [None], [None, 0, 5]):  # useless, perfect and mixed drafts
        proposer = ReplayProposer(prompt + reference, 16, schedule, VOCAB_SIZE)
        result = generate(model, tokenizer, prompt, proposer, max_tokens=100, adaptive=True)
        assert result.tokens == reference[:100]


def test_short_generations_with_cut_blocks(tiny_dir):
    """Blocks cut short by max_tokens (never a full one) must not confuse the policy."""
    policy = BlockPolicy(16)
    for block in (11, 3, 1, 1, 1, 1, 1):
        assert policy.choose() in (1, 16)
        policy.record(block, 1, 0.01)
    assert policy.choose() == 16  # no full block measured yet: measure one
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "policy-short", "qwen3", "short", 40)
    for max_tokens in range(1, 20):
        proposer = ReplayProposer(prompt + reference, 16, [2], VOCAB_SIZE)
        result = generate(model, tokenizer, prompt, proposer, max_tokens=max_tokens, adaptive=True)
        assert result.tokens == reference[:max_tokens]
