"""EOS and stop strings inside an accepted block end the output at the right token."""

import pytest
from tiny_models import VOCAB_SIZE, tiny_pair

from mlx_dflash import generate, stream_generate
from mlx_dflash.replay import ReplayProposer


@pytest.fixture(scope="module")
def pair(tiny_dir):
    return tiny_pair(tiny_dir / "stops-llama", "llama", "Once upon a time", 120)


def ascii_stop(text: str, start: int, length: int = 2) -> str:
    """A stop string of plain ASCII from the text (random bytes are often invalid UTF-8)."""
    for i in range(start, len(text) - length):
        piece = text[i : i + length]
        if piece.isascii() and piece.isprintable() and piece.strip() == piece:
            return piece
    raise AssertionError("no ASCII stretch in the reference text")


def all_right(prompt, reference):
    return ReplayProposer(prompt + reference, 16, [None], VOCAB_SIZE)


def test_eos_inside_accepted_block(pair):
    model, tokenizer, prompt, reference = pair
    index = 24  # cycle 2 covers tokens 17..32: the EOS sits mid-block
    eos = reference[index]
    first = reference.index(eos)  # the output must end at the FIRST occurrence
    tokenizer.eos_token_ids = {eos}
    try:
        result = generate(model, tokenizer, prompt, all_right(prompt, reference), max_tokens=100)
    finally:
        tokenizer.eos_token_ids = set()
    assert result.tokens == reference[:first]
    assert result.finish_reason == "stop"
    assert result.text == tokenizer.decode(reference[:first])


def test_stop_string_inside_accepted_block(pair):
    model, tokenizer, prompt, reference = pair
    full = tokenizer.decode(reference[:100])
    stop = ascii_stop(full, 30)
    cut = full.find(stop)
    result = generate(model, tokenizer, prompt, all_right(prompt, reference), max_tokens=100, stop=[stop])
    assert result.text == full[:cut]
    assert result.finish_reason == "stop"
    # tokens end with the one that completes the stop string
    n = len(result.tokens)
    assert stop in tokenizer.decode(reference[:n]) and stop not in tokenizer.decode(reference[: n - 1])


def test_streamed_text_never_passes_a_stop(pair):
    model, tokenizer, prompt, reference = pair
    full = tokenizer.decode(reference[:100])
    stop = ascii_stop(full, 45)
    pieces = [r.text for r in stream_generate(model, tokenizer, prompt, all_right(prompt, reference),
                                              max_tokens=100, stop=[stop])]
    assert "".join(pieces) == full[: full.find(stop)]


def test_max_tokens_one(pair):
    model, tokenizer, prompt, reference = pair
    result = generate(model, tokenizer, prompt, all_right(prompt, reference), max_tokens=1)
    assert result.tokens == reference[:1] and result.cycles == 0 and result.finish_reason == "length"
