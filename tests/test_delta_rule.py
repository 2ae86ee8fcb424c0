"""The chunked gated delta rule against mlx-lm's own token-by-token recurrence."""

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops

from mlx_dflash.delta_rule import MAX_BLOCK, chunk_delta_rule, state_after
from mlx_dflash.target import Target
from tiny_models import load_tiny, make_tiny_target


def _inputs(steps: int, decay_low: float, seed: int):
    """Unit-norm keys (as Qwen3.5's normalisation gives), 4 value heads over 2 key heads."""
    mx.random.seed(seed)
    unit = lambda x: x / mx.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(mx.random.normal((1, steps, 2, 32))) * 32**-0.5
    k = unit(mx.random.normal((1, steps, 2, 32)))
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
    heads_first = lambda x: mx.repeat(x, 2, axis=2).swapaxes(1, 2) if x.shape[2] == 2 else x.swapaxes(1, 2)
    y, chunk = chunk_delta_rule(heads_first(q), heads_first(k), heads_first(v), heads_first(mx.log(g)),
                                heads_first(beta), state)
    scale = mx.abs(y_ref).max().item()
    assert mx.abs(y.swapaxes(1, 2) - y_ref).max().item() <= 1e-5 * scale
    assert mx.abs(state_after(chunk, steps) - state_ref).max().item() <= 1e-5 * mx.abs(state_ref).max().item()
    for n in sorted({0, 1, steps // 2, steps - 1}):  # the state after every kind of prefix
        _, prefix_state = gated_delta_ops(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], state) if n else (None, state)
        assert mx.abs(state_after(chunk, n) - prefix_state).max().item() <= 1e-5 * mx.abs(prefix_state).max().item()


def test_rollback_of_unchunked_calls(tmp_path):
    """A single token (mlx-lm's own step) rolls back whole; a prompt longer than a block
    (mlx-lm's forward, no per-prefix states) cannot be cut partway."""
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
