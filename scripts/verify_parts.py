"""The parts of a verify block, timed on this device (for MLX's CUDA backend): attention six
ways (and the exponentials of its scores alone), and the layers' projections for a block
against one token.

    python scripts/verify_parts.py [--context 1024] [--block 16] [--layers 30] [--shapes smollm2-135m]
    MLX_CUDA_USE_CUDNN_SDPA=1 python scripts/verify_parts.py   # cuDNN's path, not ours

On an H200 a 16-token verify of SmolLM2-135M cost ~2.5 plain steps whatever the block size
from 4 up (BENCHMARKS.md, fifth session): MLX 0.32.4 fuses attention for single-token queries
only. Per shape (SmolLM2-135M, Qwen3-8B heads), ``--layers`` calls per evaluation, like one
model pass: (1) one call with all block queries and a causal mask (what mlx-lm's verify does),
(2) one single-query call per block position over its visible keys (fused kernels, more
launches), (3) one single-query call (what a plain step does). (1) and (2) must agree. Then, as
a compiled verify reads it (the whole 256-position buffer, a mask past each query), compiled:
(4) mlx-lm's masked call (MLX's fallback: two cuBLAS matmuls around a softmax), (5) the scores as
a batch of matrix-vector products (MLX's gemv kernel, the keys broadcast over the queries; no
cuBLAS), the values still one matmul, (6) both as gemv products, the values transposed first;
(5) and (6) against (4) (H200, seventeenth session: (5) and (6) no faster past 300 tokens of
context, 3.5-3.9x slower at Qwen3-8B's heads; not used). Then the
projections of ``--layers`` layers (packed QKV, output, packed gate/up, down) for ``--block``
tokens and for one: what is left of a verify's cost once attention is accounted for.
"""

import argparse
import os

import mlx.core as mx

from mlx_dflash.scale import milliseconds_per_call  # (mlx_dflash sets MLX_CUDA_USE_CUDNN_SDPA=0 if unset)

# query heads, kv heads, head dim, hidden size, MLP size
SHAPES = {"smollm2-135m": (9, 3, 64, 576, 1536), "qwen3-8b": (32, 8, 128, 4096, 12288)}

parser = argparse.ArgumentParser()
parser.add_argument("--context", type=int, default=1024)
parser.add_argument("--block", type=int, default=16)
parser.add_argument("--layers", type=int, default=30)
parser.add_argument("--iters", type=int, default=20)
parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES),
                    help="on a CPU, smollm2-135m only: Qwen3-8B's float32 projections take 23 GB")
args = parser.parse_args()
dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
print(f"{mx.default_device()}, {dtype}, MLX {mx.__version__}, "
      f"MLX_CUDA_USE_CUDNN_SDPA={os.environ.get('MLX_CUDA_USE_CUDNN_SDPA')}", flush=True)


def block_at_once(q, k, v, scale):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")


def one_query_at_a_time(q, k, v, scale):
    n, length = q.shape[2], k.shape[2]
    return mx.concatenate([
        mx.fast.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, : length - n + i + 1],
                                             v[:, :, : length - n + i + 1], scale=scale)
        for i in range(n)
    ], axis=2)


def one_query(q, k, v, scale):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


def masked_buffer(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def gemv_attention(q, k, v, scale, mask, values_by_gemv: bool):
    """Attention of a block of queries over a buffer with each product a matrix-vector one:
    scores as keys @ query per query (keys broadcast), values as value^T @ probabilities."""
    batch, heads, n, dim = q.shape
    kv_heads = k.shape[1]
    queries = (q * scale).reshape(batch, kv_heads, heads // kv_heads * n, dim)  # heads sharing a kv head
    scores = (k[:, :, None] @ queries[..., None])[..., 0]  # (batch, kv heads, group x n, keys)
    visible = mx.broadcast_to(mask, (heads // kv_heads, n, mask.shape[-1])).reshape(-1, mask.shape[-1])
    probs = mx.softmax(mx.where(visible, scores, mx.finfo(scores.dtype).min), axis=-1, precise=True)
    if values_by_gemv:
        out = (mx.contiguous(v.swapaxes(-1, -2))[:, :, None] @ probs[..., None])[..., 0]
    else:
        out = probs @ v
    return out.reshape(batch, heads, n, dim)


def timed(fn) -> float:
    return milliseconds_per_call(lambda: mx.eval(fn()), args.iters)


def projections(x, weights):
    """One layer's matmuls per weight set, the MLP's input standing in for its activation."""
    outputs = []
    for qkv, out, gate_up, down in weights:
        outputs += [x @ qkv, (((x @ out) @ gate_up)[..., : down.shape[0]]) @ down]
    return outputs


for name in args.shapes:
    heads, kv_heads, head_dim, hidden, mlp = SHAPES[name]
    length = args.context + args.block
    q = mx.random.normal((1, heads, args.block, head_dim)).astype(dtype)
    k = mx.random.normal((1, kv_heads, length, head_dim)).astype(dtype)
    v = mx.random.normal((1, kv_heads, length, head_dim)).astype(dtype)
    scale = head_dim**-0.5
    scores = mx.random.normal((1, heads, args.block, length)).astype(dtype)
    a, b = block_at_once(q, k, v, scale), one_query_at_a_time(q, k, v, scale)
    error = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
    stack = lambda fn, query: [fn(query, k, v, scale) for _ in range(args.layers)]  # noqa: E731
    results = {
        f"block of {args.block}, causal mask": timed(lambda: stack(block_at_once, q)),
        f"{args.block} single-query calls": timed(lambda: stack(one_query_at_a_time, q)),
        "one single-query call (a plain step)": timed(lambda: stack(one_query, q[:, :, -1:])),
        # the exponentials of the block's scores alone (the CPU's fallback computes them scalar)
        f"exp of the {args.block}-query scores alone": timed(lambda: [mx.exp(scores) for _ in range(args.layers)]),
    }
    print(f"{name} ({heads}/{kv_heads} heads, dim {head_dim}), context {args.context}, x{args.layers} calls, "
          f"max difference (1) vs (2) {error:.2e}:")
    for label, ms in results.items():
        print(f"  {label}: {ms:.2f} ms", flush=True)
    buffer = -(-length // 256) * 256  # as a compiled verify reads it
    kb, vb = (mx.pad(x, [(0, 0), (0, 0), (0, buffer - length), (0, 0)]) for x in (k, v))
    mask = mx.arange(buffer)[None] <= (args.context + mx.arange(args.block))[:, None]
    forms = {"masked call (mlx-lm's, MLX's fallback)": masked_buffer,
             "scores by gemv, values one matmul": lambda *a: gemv_attention(*a, values_by_gemv=False),
             "scores and values by gemv": lambda *a: gemv_attention(*a, values_by_gemv=True)}
    reference = masked_buffer(q, kb, vb, scale, mask)
    # each layer its own queries: mx.compile merges identical calls into one
    layer_queries = [mx.random.normal(q.shape).astype(dtype) for _ in range(args.layers)]
    for label, form in forms.items():
        compiled = mx.compile(lambda qs, form=form: [form(x, kb, vb, scale, mask) for x in qs])
        diff = mx.abs(form(q, kb, vb, scale, mask).astype(mx.float32) - reference.astype(mx.float32)).max().item()
        print(f"  buffer of {buffer}, {label}, compiled: {timed(lambda: compiled(layer_queries)):.2f} ms "
              f"(max difference from the masked call {diff:.2e})", flush=True)
    shapes = [(hidden, (heads + 2 * kv_heads) * head_dim), (hidden, hidden), (hidden, 2 * mlp), (mlp, hidden)]
    weights = [tuple(mx.random.normal(shape).astype(dtype) * 0.02 for shape in shapes) for _ in range(args.layers)]
    mx.eval(weights)
    for tokens in (args.block, 1):
        x = mx.random.normal((1, tokens, hidden)).astype(dtype)
        ms = timed(lambda: projections(x, weights))
        print(f"  projections of {args.layers} layers, {tokens} token(s): {ms:.2f} ms", flush=True)
