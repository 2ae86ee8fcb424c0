"""The prefix cache: a prompt that starts with a stored one prefills only the rest, and every
token equals a cold run's and mlx-lm's greedy tokens, on every family (key/value caches cut back
to a shared part; rotating caches; hybrids' recurrent states at whole stored prompts), on the
CPU's paths and the GPU's (forced); bounded by bytes, least recently used dropped first."""

import json

import mlx.core as mx
import pytest
from tiny_models import FAMILIES, MASK_ID, MORE_FAMILIES, greedy_reference, load_tiny, make_tiny_target

from mlx_dflash import create_random_draft, generate, stream_generate
from mlx_dflash.engine import prefill
from mlx_dflash.errors import DFlashError
from mlx_dflash.generate import make_proposer
from mlx_dflash.options import EngineOptions
from mlx_dflash.prefix_cache import PrefixCache, parse_bytes
from mlx_dflash.sampling import SamplingParams

MAX_TOKENS = 20
GPU_PATHS = EngineOptions(queue_ahead=True, pad_reads=True, compile_blocks=True, compile_draft=True, pack_draft=True)
HYBRIDS = {"qwen3_5", "qwen3_5_moe", "qwen3_next"}
WRAPPING = {"gemma3_text", "gpt_oss"}  # sliding windows of 8: their rotating caches wrap in these prompts
HISTORY = list(range(40, 76))  # a first turn's prompt
NEW = list(range(100, 118))  # a new message
TURN = HISTORY + NEW  # the next turn: the history, then more
EDITED = HISTORY[:20] + list(range(150, 166))  # shares only its first 20 tokens with HISTORY


@pytest.fixture(scope="module", params=[*FAMILIES, *MORE_FAMILIES])
def pair(request, tiny_dir):
    name = request.param
    path = make_tiny_target(tiny_dir / f"prefix-{name}", name)
    model, tokenizer = load_tiny(path)
    tokenizer.eos_token_ids = set()
    config = json.loads((path / "config.json").read_text())
    draft = create_random_draft(config, num_layers=1, block_size=8, mask_token_id=MASK_ID)
    return name, model, tokenizer, draft


def _run(pair, prompt, cache=None, **kwargs):
    _, model, tokenizer, draft = pair
    return generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, prefix_cache=cache, **kwargs)


@pytest.mark.parametrize("options", [EngineOptions(), GPU_PATHS], ids=["cpu-paths", "gpu-paths"])
def test_turns_equal_cold_runs_and_mlx_lm(pair, options):
    name, model = pair[0], pair[1]
    cache = PrefixCache(1 << 30)
    first = _run(pair, HISTORY, cache, options=options, adaptive=True)
    assert (first.reused_prompt_tokens, cache.hits, cache.misses) == (0, 0, 1)
    assert first.tokens == greedy_reference(model, HISTORY, MAX_TOKENS)

    # a chat's next turn resends the history and the reply: both kept (the reply's latest token
    # never ran); a recurrent state or a wrapped window only where the caches hold just them
    turn_prompt = HISTORY + first.tokens + NEW
    turn = _run(pair, turn_prompt, cache, options=options, adaptive=True)
    with_reply = len(HISTORY) + len(first.tokens) - 1
    if name in HYBRIDS | WRAPPING:
        assert turn.reused_prompt_tokens in (len(HISTORY) - 1, with_reply)
    else:
        assert turn.reused_prompt_tokens == with_reply
    assert turn.tokens == greedy_reference(model, turn_prompt, MAX_TOKENS)
    assert turn.tokens == _run(pair, turn_prompt, options=options).tokens

    # the same prompt again: all but its last token (a kept reply that runs past the prompt
    # serves all but its last two: mlx-lm's trie leaves a token of a longer entry to run)
    again = _run(pair, turn_prompt, cache, options=options)
    assert again.reused_prompt_tokens >= len(turn_prompt) - 2
    assert again.tokens == turn.tokens

    edited = _run(pair, EDITED, cache, options=options)
    # key/value caches are cut back to the shared start; a recurrent state cannot be, nor can a
    # rotating cache that has wrapped
    assert edited.reused_prompt_tokens == (0 if name in HYBRIDS | WRAPPING else 20)
    assert edited.tokens == greedy_reference(model, EDITED, MAX_TOKENS)
    # what was restored and cut back was a copy: the stored turn is intact
    assert _run(pair, turn_prompt, cache, options=options).tokens == turn.tokens


@pytest.mark.parametrize("options", [EngineOptions(), GPU_PATHS], ids=["cpu-paths", "gpu-paths"])
@pytest.mark.parametrize("stop_after", [1, 5])
def test_a_reply_stopped_early_is_kept_up_to_its_last_cycle(pair, options, stop_after):
    """A generation that its caller ends early (a stop string, a client gone) keeps what it
    committed; the next turn over it gives a cold run's tokens, also when it ends at the prefill's
    token."""
    name, model, tokenizer, draft = pair
    cache = PrefixCache(1 << 30)
    stream = stream_generate(model, tokenizer, HISTORY, draft, max_tokens=MAX_TOKENS, prefix_cache=cache, options=options)
    reply = []
    for response in stream:
        reply += response.tokens
        if len(reply) >= stop_after:
            break
    stream.close()
    turn_prompt = HISTORY + reply + NEW
    turn = _run(pair, turn_prompt, cache, options=options)
    if name not in HYBRIDS | WRAPPING:
        assert turn.reused_prompt_tokens == len(HISTORY) + len(reply) - 1
    assert turn.tokens == greedy_reference(model, turn_prompt, MAX_TOKENS)


def test_seeded_sampling_gives_the_same_tokens(pair):
    sampling = SamplingParams(temp=0.8, seed=7)
    cache = PrefixCache(1 << 30)
    _run(pair, HISTORY, cache)
    cached = _run(pair, TURN, cache, sampling=sampling)
    assert cached.reused_prompt_tokens > 0
    assert cached.tokens == _run(pair, TURN, sampling=sampling).tokens


def test_bounded_by_bytes_least_recently_used_first(tiny_dir):
    path = make_tiny_target(tiny_dir / "prefix-lru", "llama")
    model, tokenizer = load_tiny(path)
    config = json.loads((path / "config.json").read_text())
    draft = create_random_draft(config, num_layers=1, block_size=8, mask_token_id=MASK_ID)
    probe = PrefixCache(1 << 30)
    generate(model, tokenizer, HISTORY, draft, max_tokens=2, prefix_cache=probe)
    one_entry = probe.stats()["bytes"]
    assert one_entry > 0

    cache = PrefixCache(one_entry + one_entry // 2)  # room for one entry of this size
    other = list(range(200, 236))
    for prompt in (HISTORY, other):
        generate(model, tokenizer, prompt, draft, max_tokens=2, prefix_cache=cache)
    assert cache.stats()["entries"] == 1 and cache.stats()["bytes"] <= cache.max_bytes
    assert generate(model, tokenizer, other + [9], draft, max_tokens=2, prefix_cache=cache).reused_prompt_tokens > 0
    assert generate(model, tokenizer, HISTORY + [9], draft, max_tokens=2, prefix_cache=cache).reused_prompt_tokens == 0

    too_small = PrefixCache(one_entry // 2)  # an entry larger than the whole cache is not kept
    generate(model, tokenizer, HISTORY, draft, max_tokens=2, prefix_cache=too_small)
    assert too_small.stats()["entries"] == 0
    off = PrefixCache(0)
    generate(model, tokenizer, HISTORY, draft, max_tokens=2, prefix_cache=off)
    assert off.stats()["entries"] == 0

    # another draft for the same target never continues this draft's stored context
    other_draft = create_random_draft(config, num_layers=1, block_size=8, mask_token_id=MASK_ID)
    assert generate(model, tokenizer, other + [9], other_draft, max_tokens=2, prefix_cache=cache).reused_prompt_tokens == 0


@pytest.mark.parametrize("text, expected", [("0", 0), ("1024", 1024), ("2K", 2048), ("1.5M", 3 << 19), ("2GB", 2 << 30)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-1G", "nan", "inf", "1T"])
def test_parse_bytes_refuses(text):
    with pytest.raises(DFlashError):
        parse_bytes(text)


@pytest.mark.parametrize("options", [EngineOptions(), GPU_PATHS], ids=["cpu-paths", "gpu-paths"])
def test_restored_draft_context_drafts_as_a_cold_one(pair, options):
    """The draft's context is part of the entry: after a hit it drafts exactly what it drafts
    after a cold prefill (the output would not show it, only the speed)."""
    name, model, _, draft = pair

    def drafts_after_prefill(prompt, cache):
        target, proposer = make_proposer(model, draft, options)
        target_cache = target.make_cache()
        proposer.start(target)
        logits, reused = prefill(target, proposer, mx.array(prompt), target_cache, 2048, prefix_cache=cache)
        first = mx.argmax(logits).reshape(1)
        return proposer.propose(first, 7).tolist(), [c.length for c in proposer.cache], reused

    cache = PrefixCache(1 << 30)
    _run(pair, HISTORY, cache, options=options)  # (kept: the history and its reply, or the history alone)
    cold = drafts_after_prefill(TURN, None)
    warm = drafts_after_prefill(TURN, cache)
    # a kept reply cut back to the history; or the history alone, kept where caches cannot be cut
    assert warm[2] == (len(HISTORY) - 1 if name in HYBRIDS | WRAPPING else len(HISTORY))
    assert warm[:2] == cold[:2]


@pytest.mark.parametrize("step", [2048, 8])
def test_the_rest_after_a_restore_runs_in_one_pass(pair, step):
    """Key/value caches: what follows a restored prefix runs as one block, its last chunk and
    the last token together (chunks of ``step`` before it), and gives a cold prefill's first
    token; caches that cannot be cut back run the last token alone, as mlx-lm does."""
    name, model, _, draft = pair
    cache = PrefixCache(1 << 30)
    _run(pair, HISTORY, cache)
    target, proposer = make_proposer(model, draft, EngineOptions())
    rows, forward = [], target._forward
    target._forward = lambda tokens, *args, **kwargs: rows.append(tokens.shape[1]) or forward(tokens, *args, **kwargs)
    proposer.start(target)
    logits, reused = prefill(target, proposer, mx.array(TURN), target.make_cache(), step, prefix_cache=cache)
    if name in HYBRIDS | WRAPPING:  # (18 tokens, then the last)
        assert reused == len(HISTORY) - 1 and rows == ([18, 1] if step == 2048 else [8, 8, 2, 1])
    else:  # (17 tokens, then the last)
        assert reused == len(HISTORY) and rows == ([18] if step == 2048 else [8, 8, 2])
    cold, _ = prefill(target, proposer, mx.array(TURN), target.make_cache(), step)
    assert mx.argmax(logits).item() == mx.argmax(cold).item()
