"""Both forms of the gated delta rule (chunked, and stepwise: our CUDA kernel) against mlx-lm's own
token-by-token recurrence, and the rollback of each."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.gated_delta import gated_delta_ops

from mlx_dflash import generate
from mlx_dflash.delta_rule import MAX_BLOCK, chunk_delta_rule, state_after, stepwise_delta_rule
from mlx_dflash.device import on_cuda
from mlx_dflash.replay import ReplayProposer
from mlx_dflash.target import Target
from tiny_models import VOCAB_SIZE, load_tiny, make_tiny_target, tiny_pair


def _unit(x: mx.array) -> mx.array:
    """Unit-norm rows, as Qwen3.5's normalisation of q and k gives."""
    return x / mx.linalg.norm(x, axis=-1, keepdims=True)


def _inputs(steps: int, decay_low: float, seed: int):
    """Unit-norm keys, 4 value heads over 2 key heads."""
    mx.random.seed(seed)
    q = _unit(mx.random.normal((1, steps, 2, 32))) * 32**-0.5
    k = _unit(mx.random.normal((1, steps, 2, 32)))
    v = mx.random.normal((1, steps, 4, 24))
    g = mx.random.uniform(decay_low, 1.0, (1, steps, 4))
    beta = mx.random.uniform(0.0, 1.0, (1, steps, 4))
    state = mx.random.normal((1, 4, 24, 32))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("steps", [1, 5, 16, 40])
@pytest.mark.parametrize("decay_low", [0.9, 1e-3])
def test_chunk_equals_token_by_token(steps, decay_low):
    q, k, v, g, beta, state = _inputs(steps, decay_low, seed=steps)
    y_ref, state_ref = gated_delta_ops(q, k, v, g, beta, state)
    q4, k4 = (mx.repeat(x, 2, axis=2) for x in (q, k))  # the 2 key heads repeated to the 4 value heads
    y, chunk = chunk_delta_rule(*(x.swapaxes(1, 2) for x in (q4, k4, v, mx.log(g), beta)), state)
    scale = mx.abs(y_ref).max().item()
    assert mx.abs(y.swapaxes(1, 2) - y_ref).max().item() <= 1e-5 * scale
    assert mx.abs(state_after(chunk, steps) - state_ref).max().item() <= 1e-5 * mx.abs(state_ref).max().item()
    for n in sorted({0, 1, steps // 2, steps - 1}):  # the state after every kind of prefix
        _, prefix_state = gated_delta_ops(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], state) if n else (None, state)
        assert mx.abs(state_after(chunk, n) - prefix_state).max().item() <= 1e-5 * mx.abs(prefix_state).max().item()


def test_rollback_of_unchunked_calls(tmp_path):
    """A single token (mlx-lm's own step) rolls back whole; a prompt longer than a block
    (chunk after chunk, no per-prefix states kept) cannot be cut partway."""
    model, _ = load_tiny(make_tiny_target(tmp_path / "hybrid", "qwen3_5"))
    target = Target(model, [1])
    recurrent = target.recurrent_ids[0]
    cache = target.make_cache()
    target(mx.array([[5, 6, 7]]), cache)
    before = list(cache[recurrent].cache)
    target(mx.array([[8]]), cache)
    target.rollback(cache, 1)
    assert all(mx.array_equal(x, y) for x, y in zip(cache[recurrent].cache, before, strict=True))
    cache = target.make_cache()
    target(mx.array([[i % 200 for i in range(MAX_BLOCK + 6)]]), cache)
    with pytest.raises(RuntimeError, match="part of it only after a block"):
        target.rollback(cache, 5)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_long_prompts_prefill_chunk_by_chunk(tmp_path, family):
    """A prompt of several chunks: the same logits and recurrent state as mlx-lm's own
    token-by-token forward, and DFlash after it still gives mlx-lm's greedy tokens."""
    text = "".join(chr(97 + (7 * i) % 26) for i in range(3 * MAX_BLOCK + 10))
    model, tokenizer, prompt, reference = tiny_pair(tmp_path / family, family, text, 48)
    unwrapped, _ = load_tiny(tmp_path / family)
    plain_cache = make_prompt_cache(unwrapped)
    expected = unwrapped(mx.array([prompt]), cache=plain_cache)
    target = Target(model, [1])
    cache = target.make_cache()
    logits, _ = target(mx.array([prompt]), cache)
    # float noise (summation order) grows through the tiny random layers to ~2e-4 of the logits'
    # scale with OpenBLAS; a state carried wrongly between chunks moves them by whole units
    assert mx.abs(logits - expected).max().item() <= 1e-3 * mx.abs(expected).max().item()
    for i in target.recurrent_ids:
        state, want = cache[i].cache[1], plain_cache[i].cache[1]
        assert mx.abs(state - want).max().item() <= 1e-5 * mx.abs(want).max().item()
    proposer = ReplayProposer(prompt + reference, 16, [0, 3, 7, None, 1, 14], VOCAB_SIZE)
    assert generate(model, tokenizer, prompt, proposer, max_tokens=48).tokens == reference


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_stepwise_form_equals_greedy_and_rolls_back(tmp_path, family):
    """The stepwise form (CUDA's default: one kernel launch a block, which keeps the state after
    each token for a rewind), here through mlx-lm's ops: DFlash tokens equal mlx-lm
    greedy with partial acceptance of every kind, and a rollback leaves the state of feeding
    the kept tokens alone."""
    model, tokenizer, prompt, reference = tiny_pair(tmp_path / family, family, "def fib(n):\n    return", 96)
    target = Target(model, [1])
    for mixer in target._block_mixers.values():
        mixer.stepwise = True  # kept: mixers are installed once per model instance
    proposer = ReplayProposer(prompt + reference, 16, [0, 3, 7, None, 1, 14, 5], VOCAB_SIZE)
    result = generate(model, tokenizer, prompt, proposer, max_tokens=96)
    assert result.tokens == reference
    assert {1, 2, 4, 8, 16} <= set(result.acceptance_lengths)  # rewinds to many prefixes
    target = Target(model, [1])  # generate tapped other layers; the mixers stay stepwise
    assert all(mixer.stepwise for mixer in target._block_mixers.values())
    block = mx.array([reference[:16]])
    for keep in (2, 9):
        rolled, direct = target.make_cache(), target.make_cache()
        for cache in (rolled, direct):
            target(mx.array([prompt]), cache)
        target(block, rolled)
        target.rollback(rolled, 16 - keep)
        target(block[:, :keep], direct)
        for i in target.recurrent_ids:
            for x, y in zip(rolled[i].cache, direct[i].cache, strict=True):
                # projections of 16 rows vs `keep` rows round differently (~1e-6); a wrong prefix: whole units
                assert mx.abs(x - y).max().item() <= 1e-5 * max(mx.abs(y).max().item(), 1.0)


@pytest.mark.skipif(not on_cuda(), reason="the kernel runs on MLX's CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_cuda_kernel_equals_mlx_lm_ops(dtype):
    """Our CUDA kernel against mlx-lm's token-by-token ops, at Qwen3.5-9B's head sizes
    (16 key heads of 128, 32 value heads of 128), 16 tokens and a 300-token prompt."""
    for steps in (16, 300):
        mx.random.seed(steps)
        q = (_unit(mx.random.normal((1, steps, 16, 128))) * 128**-0.5).astype(dtype)
        k = _unit(mx.random.normal((1, steps, 16, 128))).astype(dtype)
        v = mx.random.normal((1, steps, 32, 128)).astype(dtype)
        g = mx.random.uniform(0.5, 1.0, (1, steps, 32))
        beta = mx.random.uniform(0.0, 1.0, (1, steps, 32)).astype(dtype)
        state = mx.random.normal((1, 32, 128, 128))
        y, final, states = stepwise_delta_rule(q, k, v, g, beta, state, save_states=steps == 16)
        y_ref, final_ref = gated_delta_ops(q, k, v, g, beta, state)
        assert y.dtype == y_ref.dtype == dtype
        tolerance = 1e-2 if dtype == mx.bfloat16 else 1e-5  # bf16 outputs: a rounding step apart
        assert mx.abs(y.astype(mx.float32) - y_ref.astype(mx.float32)).max().item() <= tolerance * mx.abs(y_ref).max().item()
        assert mx.abs(final - final_ref).max().item() <= 1e-5 * mx.abs(final_ref).max().item()
        if steps == 16:  # the state after every prefix, as a rewind reads it
            for n in (1, 7, 15, 16):
                _, want = gated_delta_ops(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], state)
                assert mx.abs(states[n - 1] - want).max().item() <= 1e-5 * mx.abs(want).max().item()
