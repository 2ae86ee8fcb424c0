"""Block attention on NVIDIA GPUs in one kernel launch.

MLX's CUDA backend has a fused attention kernel for one query only; the queries of a block
(a verify's 2-64 tokens, a draft pass's block) take its fallback instead: a scaled copy of
the queries, a cuBLAS matmul, the mask, a softmax and a second matmul, five launches a layer.
A small model's cycle on a large GPU is bound by the host launching kernels, so
``block_attention`` computes it in one launch: one thread
block per (query, head, batch), its warps walking the keys with an online softmax in float32,
merged in shared memory at the end (the one-query kernel's scheme, for many queries and a mask).

It takes what a block's attention passes (``mx.fast.scaled_dot_product_attention``'s
arguments): no mask, "causal", or a boolean [queries, keys] mask (a batch's: [batch, 1, queries,
keys], each row its own); head sizes a multiple of 32
up to 256; any strides (no copies of the transposed queries or of a cache's sliced buffer); up
to ``MAX_HEADS_TIMES_KEYS`` query heads x keys, where it measured faster than MLX's call.
Anything else, and any other backend, keeps MLX's own call (``fits``).
"""

from __future__ import annotations

import struct
from functools import lru_cache
from typing import Union

import mlx.core as mx

from .device import on_cuda

WARPS = 16  # warps per (query, head): each walks every WARPS-th key
MAX_HEAD_DIM = 256
# The kernel's work grows with query heads x keys (each (query, head) walks every key, one warp
# reduction a key), while MLX's fallback, launch-bound, barely grows: past the crossover measured
# on an H200 (the lowest of three models', docs/performance.md), MLX's own call. Trees and batches
# keep it: a limit shrunk by their queries or rows made trees no faster and batches slower end to
# end, though alone ours is slower there (MLX's call adds host work, which a pipelined cycle pays).
MAX_HEADS_TIMES_KEYS = 14 * 1024

_SOURCE = """
    constexpr int per_lane = D / 32;
    const float lowest = -__int_as_float(0x7f800000);  // -infinity
    const int lane = threadIdx.x, warp = threadIdx.y;
    const int i = blockIdx.x, h = blockIdx.y, b = blockIdx.z;  // query position, query head, batch
    const int L = q_shape[2], S = k_shape[2];
    const int kv_h = h / (q_shape[1] / k_shape[1]);  // query heads sharing a key head are adjacent
    const T* qp = q + b * q_strides[0] + h * q_strides[1] + i * q_strides[2];
    const T* kp = k + b * k_strides[0] + kv_h * k_strides[1];
    const T* vp = v + b * v_strides[0] + kv_h * v_strides[1];
    float query[per_lane], acc[per_lane];
    for (int d = 0; d < per_lane; ++d) {
      query[d] = __int_as_float(ScaleBits) * static_cast<float>(qp[(d * 32 + lane) * q_strides[3]]);
      acc[d] = 0.0f;
    }
    float top = lowest, total = 0.0f;  // this warp's running max and sum of exponentials
    for (int j = warp; j < S; j += Warps) {
      bool visible = true;
      if (MaskKind == 1) visible = j <= S - L + i;  // causal: the queries are the last L positions
      if (MaskKind == 2) visible = mask[b * mask_strides[0] + i * mask_strides[1] + j * mask_strides[2]];
      if (!visible) continue;  // (the same j for the whole warp)
      float score = 0.0f;
      for (int d = 0; d < per_lane; ++d)
        score += query[d] * static_cast<float>(kp[j * k_strides[2] + (d * 32 + lane) * k_strides[3]]);
      for (int gap = 16; gap > 0; gap >>= 1) score += __shfl_xor_sync(0xffffffff, score, gap);
      const float new_top = fmaxf(top, score);
      const float rescale = expf(top - new_top), weight = expf(score - new_top);
      total = total * rescale + weight;
      for (int d = 0; d < per_lane; ++d)
        acc[d] = acc[d] * rescale + weight * static_cast<float>(vp[j * v_strides[2] + (d * 32 + lane) * v_strides[3]]);
      top = new_top;
    }
    __shared__ float tops[Warps], totals[Warps], accs[Warps][D];
    if (lane == 0) { tops[warp] = top; totals[warp] = total; }
    for (int d = 0; d < per_lane; ++d) accs[warp][d * 32 + lane] = acc[d];
    __syncthreads();
    for (int c = warp * 32 + lane; c < D; c += Warps * 32) {
      float overall = lowest;
      for (int w = 0; w < Warps; ++w) overall = fmaxf(overall, tops[w]);
      float sum = 0.0f, value = 0.0f;
      for (int w = 0; w < Warps; ++w) {
        const float factor = tops[w] == lowest ? 0.0f : expf(tops[w] - overall);
        sum += totals[w] * factor;
        value += accs[w][c] * factor;
      }
      out[((size_t)(b * L + i) * gridDim.y + h) * D + c] = static_cast<T>(sum > 0.0f ? value / sum : 0.0f);
    }
"""
_kernel = None  # built at first use (needs MLX's CUDA backend)


@lru_cache(maxsize=1)
def _placeholder_mask() -> mx.array:
    return mx.ones((1, 1), mx.bool_)


def fits(queries: mx.array, keys: mx.array, values: mx.array, mask: Union[None, str, mx.array]) -> bool:
    """Whether ``block_attention`` takes this call: on CUDA, several queries, one dtype and one
    head size for queries, keys and values that it handles, key heads dividing query heads, a mask it reads,
    and few enough keys to be faster than MLX's call (``MAX_HEADS_TIMES_KEYS``)."""
    D = queries.shape[-1]
    if isinstance(mask, mx.array):
        L, S = queries.shape[2], keys.shape[2]
        mask_ok = mask.dtype == mx.bool_ and mask.shape in ((L, S), (queries.shape[0], 1, L, S))
    else:
        mask_ok = mask is None or mask == "causal"
    return (on_cuda() and queries.ndim == 4 and queries.shape[2] > 1 and mask_ok
            and queries.dtype == keys.dtype == values.dtype and D % 32 == 0 and D <= MAX_HEAD_DIM and keys.shape[-1] == D and values.shape[-1] == D
            and queries.shape[1] % keys.shape[1] == 0 and queries.shape[1] * keys.shape[2] <= MAX_HEADS_TIMES_KEYS)


def block_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                    mask: Union[None, str, mx.array]) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)``
    for a call ``fits`` takes: [B, heads, L, D] queries, [B, key heads, S, D] keys and values.
    Written as [B, L, heads, D] and returned as its transposed view: callers transpose it back
    and flatten the heads, which is then free (MLX's [B, heads, L, D] needs a copy kernel there,
    one a layer)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="dflash_block_attention", input_names=["q", "k", "v", "mask"], output_names=["out"],
            source=_SOURCE, ensure_row_contiguous=False)
    B, n_heads, L, D = queries.shape
    if isinstance(mask, mx.array):  # (read as [B, L, S]: a mask shared by the batch with a stride of 0)
        kind, mask_input = 2, mx.broadcast_to(mask.reshape(-1, L, mask.shape[-1]), (B, L, mask.shape[-1]))
    else:  # (the kernel reads no mask: any small boolean array fills its place)
        kind, mask_input = (1 if mask == "causal" else 0), _placeholder_mask()
    scale_bits = struct.unpack("<i", struct.pack("<f", scale))[0]  # (templates take ints: the float's bits)
    (out,) = _kernel(
        inputs=[queries, keys, values, mask_input],
        template=[("T", queries.dtype), ("D", D), ("Warps", WARPS), ("MaskKind", kind), ("ScaleBits", scale_bits)],
        grid=(L * 32, n_heads * WARPS, B), threadgroup=(32, WARPS, 1),
        output_shapes=[(B, L, n_heads, D)], output_dtypes=[queries.dtype])
    return out.transpose(0, 2, 1, 3)
