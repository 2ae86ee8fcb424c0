"""cpu_kernels: the vectorized exponential, the attention and SwiGLU built on it, RoPE on shared
tables, and their per-instance installation in a target's blocks."""

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.base as mlx_lm_base
import mlx_lm.models.llama as mlx_lm_llama
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu
from mlx_lm.models.cache import make_prompt_cache
from tiny_models import load_tiny, make_tiny_target

from mlx_dflash import cpu_kernels
from mlx_dflash.cpu_kernels import BlockKernels, ReboundModule, attention, exp, rope, shifted_exp, swiglu
from mlx_dflash.projections import swapped


def test_exp_is_within_an_ulp_of_mlx_exp():
    """Over the whole range where exp is a normal float32, and at its ends: 0 for -inf and
    below the range, finite above it."""
    x = mx.concatenate([mx.linspace(-87, 88, 200_001), mx.random.normal((10_000,)) * 5,
                        mx.array([0.0, -0.5, 0.5, 1e-8, -1e-8])])
    ours, theirs = np.array(exp(x)), np.array(mx.exp(x))
    relative = np.abs(ours - theirs) / theirs
    assert relative.max() <= 2.4e-7, relative.max()  # one ulp is 1.2e-7 (2**-23) at the worst
    assert np.array_equal(np.array(exp(mx.array([0.0]))), [1.0])
    ends = np.array(exp(mx.array([-np.inf, -100.0, -88.5, 100.0])))
    assert list(ends[:3]) == [0.0, 0.0, 0.0] and np.isfinite(ends[3]) and ends[3] > 1e38


@pytest.mark.parametrize("mask", [None, "causal", "bool", "additive", "per-head"])
def test_attention_equals_mlx_fast_attention(mask):
    """Grouped query heads (6 over 2 key heads), a block of 5 queries over 12 keys, under each
    kind of mask mlx-lm passes."""
    mx.random.seed(3)
    q, k, v = mx.random.normal((1, 6, 5, 16)), mx.random.normal((1, 2, 12, 16)), mx.random.normal((1, 2, 12, 16))
    visible = mx.arange(12)[None] <= (6 + mx.arange(5))[:, None]  # query i at position 6 + i
    masks = {None: None, "causal": "causal", "bool": visible,
             "additive": mx.where(visible, 0.0, -1e9)[None, None],
             "per-head": mx.random.uniform(shape=(1, 6, 5, 12)) > 0.3}
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=masks[mask])
    got = attention(q, k, v, 0.25, masks[mask])
    assert got.shape == expected.shape
    assert mx.abs(got - expected).max().item() <= 1e-5 * mx.abs(expected).max().item()


def test_swiglu_equals_mlx_lms():
    gate, x = mx.random.normal((1, 7, 64)) * 6, mx.random.normal((1, 7, 64))
    expected = mlx_lm_swiglu(gate, x)
    assert mx.abs(swiglu(gate, x) - expected).max().item() <= 1e-6 * mx.abs(expected).max().item()


def test_one_query_and_half_precision_keep_mlxs_own_kernels():
    """A one-token step is bit for bit mlx-lm's; bfloat16 would lose the polynomial's digits."""
    q, k, v = mx.random.normal((1, 4, 1, 16)), mx.random.normal((1, 2, 9, 16)), mx.random.normal((1, 2, 9, 16))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25)
    assert mx.array_equal(attention(q, k, v, 0.25, None), expected).item()
    q, k, v = (t.astype(mx.bfloat16) for t in (mx.random.normal((1, 4, 3, 16)), k, v))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert mx.array_equal(attention(q, k, v, 0.25, "causal"), expected).item()
    gate = mx.random.normal((1, 1, 64))
    assert mx.array_equal(swiglu(gate, gate), mlx_lm_swiglu(gate, gate)).item()


@pytest.mark.parametrize("base,scale", [(10_000.0, 1.0), (100_000.0, 0.25), (1e6, 1.0)])
def test_rope_is_nn_ropes_bit_for_bit(base, scale):
    """Every length and offset, queries and keys of one forward sharing one table."""
    module = nn.RoPE(32, base=base, scale=scale)
    for length in (1, 5, 16):
        for offset in (0, 7, 300, 40_000):
            for heads in (6, 2):
                x = mx.random.normal((1, heads, length, 32)) * 3
                assert mx.array_equal(rope(module, x, offset), module(x, offset=offset)).item()
    made = cpu_kernels._rotations.cache_info().misses
    rope(module, mx.random.normal((1, 6, 5, 32)), 123), rope(module, mx.random.normal((1, 2, 5, 32)), 123)
    assert cpu_kernels._rotations.cache_info().misses == made + 1


@pytest.mark.parametrize("base,scale", [(10_000.0, 1.0), (1e6, 0.5)])
def test_rope_at_a_trees_depths_is_each_nodes_own_rope(base, scale):
    """A tree's nodes from the shared tables: bit for bit each node rotated at its own position;
    None (the caller's per-node rotation) where the tables do not apply."""
    module = nn.RoPE(32, base=base, scale=scale)
    depths = [0, 1, 2, 2, 3, 3, 3, 5, 9]
    x = mx.random.normal((1, 4, len(depths), 32)) * 3
    for offset in (0, 211):
        each = mx.concatenate([module(x[:, :, i : i + 1], offset=offset + d) for i, d in enumerate(depths)], axis=2)
        assert mx.array_equal(cpu_kernels.rope_at_depths(module, x, offset, depths), each).item()
    for other, t, offset in [(nn.RoPE(32, traditional=True), x, 3), (module, x.astype(mx.bfloat16), 3),
                             (module, x, mx.array(3))]:
        assert cpu_kernels.rope_at_depths(other, t, offset, depths) is None


def test_rope_leaves_other_cases_to_the_module(monkeypatch):
    """Traditional or partial rotations, subclasses (their own frequencies), offsets on the
    device, half precision and GPUs: the module's own call."""
    monkeypatch.setattr(cpu_kernels, "_rotate", lambda *a: pytest.fail("not ours to rotate"))

    class Scaled(nn.RoPE):
        pass
    x = mx.random.normal((1, 2, 4, 32))
    for module, t, offset in [(nn.RoPE(32, traditional=True), x, 3), (nn.RoPE(16), x, 3), (Scaled(32), x, 3),
                              (nn.RoPE(32), x, mx.array(3)), (nn.RoPE(32), x.astype(mx.bfloat16), 3)]:
        assert mx.array_equal(rope(module, t, offset), module(t, offset=offset)).item()
    monkeypatch.setattr(cpu_kernels, "on_gpu", lambda: True)
    assert mx.array_equal(rope(nn.RoPE(32), x, 3), nn.RoPE(32)(x, offset=3)).item()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_models_rope_swapped_alone_changes_no_bit(tiny_dir, family):
    """Each layer's RoPE module replaced by ``rope`` (a block of 19 tokens after a prompt of 6,
    so every layer rotates at offset 6 from one shared table): the model's very outputs."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / f"kernels-rope-{family}", family))
    ropes = BlockKernels(model).rope_swaps  # (what ``exact()`` installs)
    assert len(ropes) == len(model.layers) and all(type(swap[2]) is nn.RoPE for swap in ropes)
    prompt, block = mx.array([[3, 1, 4, 1, 5, 9]]), mx.array([[(5 * i) % 250 for i in range(19)]])
    cache = make_prompt_cache(model)
    model(prompt, cache=cache)
    expected = model(block, cache=cache)
    for layer_cache in cache:
        layer_cache.trim(19)
    with swapped(ropes):
        got = model(block, cache=cache)
    assert mx.array_equal(got, expected).item()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gpt_oss", "qwen3_5"])
def test_block_kernels_give_the_models_own_outputs(tiny_dir, family):
    """Installed, each attention and SwiGLU module runs mlx-lm's own code with our functions
    (gpt-oss: its attention sinks and its own activation stay mlx-lm's): the model's outputs
    to float32 rounding; outside, the model is mlx-lm's again, and mlx-lm's modules were never
    patched."""
    path = make_tiny_target(tiny_dir / f"kernels-{family}", family)
    model, _ = load_tiny(path)
    kernels = BlockKernels(model)
    assert len(kernels.swaps) >= len(model.layers)  # (each layer's attention or MLP, at least)
    block = mx.array([[(5 * i) % 250 for i in range(19)]])
    expected = model(block)
    with kernels.installed():
        assert all(isinstance(parent[name], ReboundModule) for parent, name, _, _ in kernels.swaps)
        got = model(block)
        assert mlx_lm_llama.scaled_dot_product_attention is mlx_lm_base.scaled_dot_product_attention
        assert mlx_lm_llama.swiglu is mlx_lm_swiglu
    gap = mx.abs(got - expected).max().item() / mx.abs(expected).max().item()
    assert 0 < gap <= 1e-5 or family == "gpt_oss", gap  # (our exp and order of operations: the last bits differ)
    assert all(parent[name] is own for parent, name, own, _ in kernels.swaps)
    assert mx.array_equal(model(block), expected).item()


def test_block_kernels_only_where_they_pay(tiny_dir, monkeypatch):
    """A float32 model on the CPU; none on a GPU or in half precision."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / "kernels-where", "llama"))
    assert cpu_kernels.block_kernels(model, mx.float32) is not None
    assert cpu_kernels.block_kernels(model, mx.bfloat16) is None
    monkeypatch.setattr(cpu_kernels, "on_gpu", lambda: True)
    assert cpu_kernels.block_kernels(model, mx.float32) is None


def test_exp_has_exps_gradient():
    """A draft trained on the CPU differentiates through its SwiGLU."""
    x = mx.linspace(-5, 5, 11)
    grad = mx.grad(lambda t: exp(t).sum())(x)
    assert mx.allclose(grad, mx.exp(x), rtol=1e-6).item()


@pytest.mark.parametrize("shift_shape", [(2, 3, 5, 1), (2, 1, 5, 1), ()])
def test_shifted_exp_is_exp_of_the_difference_with_its_gradients(shift_shape):
    """shifted_exp(x, shift) gives exp's numbers for x - shift bit for bit (a softmax's shifted
    scores never written out), and the gradients of exp(x - shift) for both arguments, a
    broadcast shift's summed over the axes it was broadcast along."""
    x = mx.random.normal((2, 3, 5, 7), key=mx.random.key(0)) * 10
    shift = x.max(axis=(1, 3), keepdims=True) if shift_shape == (2, 1, 5, 1) else (
        x.max(axis=-1, keepdims=True) if shift_shape else x.max())
    assert shift.shape == shift_shape
    assert mx.array_equal(shifted_exp(x, shift), exp(x - shift)).item()
    w = mx.random.normal(x.shape, key=mx.random.key(1))
    ours = mx.grad(lambda a, b: (shifted_exp(a, b) * w).sum(), argnums=(0, 1))(x, shift)
    theirs = mx.grad(lambda a, b: (mx.exp(a - b) * w).sum(), argnums=(0, 1))(x, shift)
    for o, t in zip(ours, theirs):
        assert o.shape == t.shape and mx.allclose(o, t, rtol=1e-5, atol=1e-5).item()


def test_a_target_uses_them_for_blocks_and_only_rope_elsewhere(tiny_dir, monkeypatch):
    """A verify block runs on them, eager or compiled; a prompt and a one-token step run mlx-lm's
    code with RoPE from shared tables alone (the first token and every plain step stay mlx-lm's
    bit for bit)."""
    from mlx_dflash.target import Target

    calls, rotations = [], []
    own_attention, own_rotate = cpu_kernels.attention, cpu_kernels._rotate
    monkeypatch.setattr(cpu_kernels, "attention", lambda *a: calls.append(a[0].shape[2]) or own_attention(*a))
    monkeypatch.setattr(cpu_kernels, "_rotate", lambda *a: rotations.append(a[0].shape[2]) or own_rotate(*a))
    model, _ = load_tiny(make_tiny_target(tiny_dir / "kernels-target", "llama"))
    target = Target(model, [1, 3])
    cache, own_cache = target.make_cache(), make_prompt_cache(model)
    prompt, step = mx.array([list(range(30, 50))]), mx.array([[7]])
    assert mx.array_equal(target(prompt, cache, prompt=True)[0], model(prompt, cache=own_cache)).item()
    assert mx.array_equal(target(step, cache)[0], model(step, cache=own_cache)).item()
    assert calls == [] and rotations == [20] * 2 * len(model.layers) + [1] * 2 * len(model.layers)
    target(mx.array([list(range(60, 76))]), cache)  # (16 tokens: an eager block on the CPU)
    assert calls == [16] * len(model.layers)
    target(mx.array([list(range(80, 84))]), cache)  # (4 tokens: a compiled one, traced now)
    assert calls == [16] * len(model.layers) + [4] * len(model.layers)


def test_only_mlx_lms_own_functions_with_their_known_parameters_are_rebound(tiny_dir, monkeypatch):
    """A module reading another function under one of these names keeps it, and so does every
    module once mlx-lm's function takes other parameters than ours (a later mlx-lm); RoPE
    modules are swapped for ``rope`` regardless."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / "kernels-names", "llama"))
    kinds = {type(own).__name__ for _, _, own, _ in BlockKernels(model).swaps}
    assert kinds == {"Attention", "MLP", "RoPE"}
    monkeypatch.setitem(mlx_lm_llama.__dict__, "swiglu", lambda gate, x: gate * x)
    assert {type(own).__name__ for _, _, own, _ in BlockKernels(model).swaps} == {"Attention", "RoPE"}

    def changed(queries, keys, values, cache, scale, mask, sinks=None, window=None):
        raise AssertionError("not to be called")
    monkeypatch.setitem(cpu_kernels.MLX_LM_FUNCTIONS, "scaled_dot_product_attention", changed)
    monkeypatch.setitem(mlx_lm_llama.__dict__, "scaled_dot_product_attention", changed)
    assert {type(own).__name__ for _, _, own, _ in BlockKernels(model).swaps} == {"RoPE"}


def test_a_blocks_causal_mask_is_kept_per_thread():
    """The mask is built lazily on its thread's stream: another thread (a server's model thread
    beside a caller's) gets its own, never an array that thread has not evaluated; one thread's
    layers share one."""
    import threading

    from mlx_dflash.cpu_kernels import _causal_mask

    def mask() -> mx.array:
        return _causal_mask(16, 300, 3, threading.get_ident())

    mine = mask()
    theirs = []
    worker = threading.Thread(target=lambda: theirs.append((mask(), mask(), np.array(mask()))))
    worker.start()
    worker.join()
    assert theirs[0][0] is theirs[0][1] and mine is mask()
    assert theirs[0][0] is not mine  # (evaluating the other thread's here would fail: its stream is not this thread's)
    assert np.array_equal(theirs[0][2], np.array(mine))
