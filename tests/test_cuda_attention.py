"""cuda_attention: which calls the CUDA block-attention kernel takes and how a target binds it
(checked anywhere); its outputs against MLX's own attention, and DFlash through it against
mlx-lm greedy (on MLX's CUDA backend only)."""

import mlx.core as mx
import pytest
from tiny_models import VOCAB_SIZE, load_tiny, make_tiny_target, tiny_pair

from mlx_dflash import cpu_kernels, cuda_attention, generate
from mlx_dflash.device import on_cuda
from mlx_dflash.replay import ReplayProposer
from mlx_dflash.rollback import visible_keys

ON_CUDA = pytest.mark.skipif(not on_cuda(), reason="the kernel runs on MLX's CUDA backend only")


def _qkv(heads=9, kv_heads=3, length=16, keys=40, dim=64, dtype=mx.float32):
    mx.random.seed(7)
    return (mx.random.normal((1, heads, length, dim)).astype(dtype), mx.random.normal((1, kv_heads, keys, dim)).astype(dtype),
            mx.random.normal((1, kv_heads, keys, dim)).astype(dtype))


def test_it_takes_block_attention_on_cuda_only(monkeypatch):
    """Off CUDA never; on CUDA several queries under no mask, "causal" or a boolean [queries,
    keys] mask, head sizes that are multiples of 32 up to 256, key heads dividing query heads,
    and query heads x keys up to the measured crossover with MLX's call."""
    q, k, v = _qkv()
    visible = visible_keys(40, mx.array(24), 16)
    assert cuda_attention.fits(q, k, v, visible) == on_cuda()
    monkeypatch.setattr(cuda_attention, "on_cuda", lambda: True)
    for mask in (None, "causal", visible):
        assert cuda_attention.fits(q, k, v, mask)
    for dim in (128, 256):
        assert cuda_attention.fits(*_qkv(dim=dim), visible)
    assert not cuda_attention.fits(q[:, :, :1], k, v, None)  # one query: MLX's own fused kernel
    assert not cuda_attention.fits(*_qkv(dim=80), None)
    assert not cuda_attention.fits(*_qkv(dim=512), None)
    assert not cuda_attention.fits(*_qkv(heads=8), None)  # 8 query heads over 3 key heads
    assert not cuda_attention.fits(q, k, v[..., :32], None)  # values of another size
    assert not cuda_attention.fits(q, k.astype(mx.bfloat16), v.astype(mx.bfloat16), None)  # (it reads one dtype)
    assert not cuda_attention.fits(q, k, v, mx.where(visible, 0.0, -1e9))  # additive
    assert not cuda_attention.fits(q, k, v, mx.broadcast_to(visible, (1, 9, 16, 40)))  # [B, heads, L, S]
    batch = [mx.concatenate([x, x]) for x in (q, k, v)]
    rows = visible_keys(40, mx.array([24, 3]), 16)  # [B, 1, L, S]: each row its own
    assert cuda_attention.fits(*batch, rows) and cuda_attention.fits(*batch, visible)
    assert not cuda_attention.fits(q, k, v, rows)  # (masks of two rows for one)
    assert not cuda_attention.fits(q, k, v, visible[:1])  # [1, S]: broadcast over the queries
    assert cuda_attention.fits(*_qkv(keys=1592), None)  # 9 heads x 1,592 keys: at most 14,336
    assert not cuda_attention.fits(*_qkv(keys=1593), None)  # past it MLX's call may be the faster


def test_a_cuda_target_rebinds_attention_alone(tiny_dir, monkeypatch):
    """On CUDA a model's blocks get the kernel through its attention modules; its MLPs and RoPE
    modules stay its own (MLX's fused GPU kernels), and prompts and steps swap nothing."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / "cuda-rebind", "llama"))
    monkeypatch.setattr(cpu_kernels, "on_gpu", lambda: True)
    monkeypatch.setattr(cpu_kernels, "on_cuda", lambda: True)
    for dtype in (mx.float32, mx.bfloat16):
        kernels = cpu_kernels.block_kernels(model, dtype)
        assert {type(own).__name__ for _, _, own, _ in kernels.swaps} == {"Attention"}
        assert len(kernels.swaps) == len(model.layers) and kernels.rope_swaps == []


@ON_CUDA
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_kernel_equals_mlx_attention(dtype, dim):
    """Grouped heads, blocks of 2-64 queries over a padded 256-key buffer under a verify's mask
    (stale keys past each query), "causal" and no mask; transposed queries and a sliced buffer
    (strides, no copies); compiled too; a batch's rows, each with its own mask or one shared."""
    tolerance = 2e-5 if dtype == mx.float32 else 2e-2
    for length, keys, offset in ((2, 256, 0), (16, 256, 100), (16, 512, 300), (64, 256, 150)):
        q, k, v = _qkv(length=length, keys=keys, dim=dim, dtype=dtype)
        for mask in (visible_keys(keys, mx.array(offset), length), "causal", None):
            expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask)
            got = cuda_attention.block_attention(q, k, v, dim**-0.5, mask)
            assert got.dtype == dtype and got.shape == expected.shape
            assert mx.allclose(got, expected, atol=tolerance, rtol=tolerance).item(), (length, keys, mask)
    q, k, v = _qkv(length=16, keys=300, dim=dim, dtype=dtype)
    q_strided = q.transpose(0, 2, 1, 3).reshape(1, 16, -1).reshape(1, 16, 9, dim).transpose(0, 2, 1, 3)
    mask = visible_keys(200, mx.array(150), 16)
    expected = mx.fast.scaled_dot_product_attention(q, k[:, :, :200], v[:, :, :200], scale=0.1, mask=mask)
    assert mx.allclose(cuda_attention.block_attention(q_strided, k[:, :, :200], v[:, :, :200], 0.1, mask),
                       expected, atol=tolerance, rtol=tolerance).item()
    compiled = mx.compile(lambda q, k, v, m: cuda_attention.block_attention(q, k, v, 0.1, m))
    assert mx.allclose(compiled(q, k[:, :, :200], v[:, :, :200], mask), expected, atol=tolerance, rtol=tolerance).item()
    rows = [mx.concatenate([x, x[..., ::-1, :], -x]) for x in (q, k, v)]  # a batch of 3
    for mask in (visible_keys(300, mx.array([0, 150, 280]), 16), visible_keys(300, mx.array(150), 16), "causal"):
        expected = mx.fast.scaled_dot_product_attention(*rows, scale=0.1, mask=mask)
        assert mx.allclose(cuda_attention.block_attention(*rows, 0.1, mask), expected, atol=tolerance,
                           rtol=tolerance).item()


@ON_CUDA
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_dflash_through_the_kernel_equals_greedy(tiny_dir, family, monkeypatch):
    """A target with 64-wide heads (the kernel's) verifies every block through it, with every
    kind of partial acceptance: its tokens are mlx-lm's greedy ones."""
    calls = []
    own = cuda_attention.block_attention
    monkeypatch.setattr(cuda_attention, "block_attention", lambda *a: calls.append(a[0].shape) or own(*a))
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / f"cuda-{family}", family, "def fib(n):", 120,
                                                    head_dim=64)
    proposer = ReplayProposer(prompt + reference, 16, [0, 3, 7, None, 1, 14, 5], VOCAB_SIZE)
    assert generate(model, tokenizer, prompt, proposer, max_tokens=120).tokens == reference
    assert calls and all(shape[-1] == 64 and shape[2] > 1 for shape in calls)
