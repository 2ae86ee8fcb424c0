"""Every acceptance length commits and rolls back right (replayed drafts with planted mistakes)."""

import pytest
from tiny_models import VOCAB_SIZE, tiny_pair

from mlx_dflash import generate
from mlx_dflash.replay import ReplayProposer

BLOCK = 16


@pytest.fixture(scope="module")
def pair(tiny_dir):
    return tiny_pair(tiny_dir / "accept-qwen3", "qwen3", "The quick brown fox", 200)


@pytest.mark.parametrize("correct", list(range(BLOCK - 1)) + [None])
def test_each_acceptance_length(pair, correct):
    """A mistake after `correct` right drafts gives acceptance length correct+1 every cycle."""
    model, tokenizer, prompt, reference = pair
    proposer = ReplayProposer(prompt + reference, BLOCK, [correct], VOCAB_SIZE)
    max_tokens = 1 + 5 * (BLOCK if correct is None else correct + 1)
    result = generate(model, tokenizer, prompt, proposer, max_tokens=max_tokens)
    assert result.tokens == reference[:max_tokens]
    expected = BLOCK if correct is None else correct + 1
    assert result.acceptance_lengths == [expected] * 5


def test_mixed_lengths_and_partial_last_block(pair):
    """Mixed acceptance in one sequence, ending with a block cut short by max_tokens."""
    model, tokenizer, prompt, reference = pair
    schedule = [None, 0, 3, 7, 15, 14, 9, 1]
    proposer = ReplayProposer(prompt + reference, BLOCK, schedule, VOCAB_SIZE)
    max_tokens = 1 + 16 + 1 + 4 + 8 + 16 + 15 + 10 + 2 + 7  # the last block is 7 < 16 tokens
    result = generate(model, tokenizer, prompt, proposer, max_tokens=max_tokens)
    assert result.tokens == reference[:max_tokens]
    assert result.acceptance_lengths == [16, 1, 4, 8, 16, 15, 10, 2, 7]
    assert result.finish_reason == "length"


def test_smaller_block_size_than_draft(pair):
    model, tokenizer, prompt, reference = pair
    proposer = ReplayProposer(prompt + reference, BLOCK, [None], VOCAB_SIZE)
    result = generate(model, tokenizer, prompt, proposer, max_tokens=41, block_size=4)
    assert result.tokens == reference[:41]
    assert result.acceptance_lengths == [4] * 10
