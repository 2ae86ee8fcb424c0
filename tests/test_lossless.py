"""DFlash output equals mlx-lm's own greedy decoding, token for token."""

import json

import pytest
from tiny_models import MASK_ID, greedy_reference, load_tiny

from mlx_dflash import create_random_draft, generate

MAX_TOKENS = 72


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_dflash_equals_mlx_lm_greedy(tiny_target_path, block_size):
    model, tokenizer = load_tiny(tiny_target_path)
    tokenizer.eos_token_ids = set()  # random weights: run the full length
    prompt = tokenizer.encode("def fib(n):\n    return")
    expected = greedy_reference(model, prompt, MAX_TOKENS)
    config = json.loads((tiny_target_path / "config.json").read_text())
    draft = create_random_draft(config, num_layers=2, block_size=16, mask_token_id=MASK_ID)
    result = generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, block_size=block_size)
    assert result.tokens == expected
    assert len(result.tokens) == MAX_TOKENS
    assert result.cycles == len(result.acceptance_lengths) > 0
    assert all(1 <= a <= block_size for a in result.acceptance_lengths)
    assert 1 + sum(result.acceptance_lengths) == MAX_TOKENS
