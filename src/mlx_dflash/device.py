"""Where MLX runs, for the few choices that differ by backend."""

from __future__ import annotations

import mlx.core as mx


def on_apple_gpu() -> bool:
    """Metal: its fused kernels (a Gated DeltaNet prompt in one launch) and its precompiled
    quantized matmuls change what is fastest; the CPU and CUDA share the other path."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def on_cuda() -> bool:
    """NVIDIA GPUs (MLX's CUDA backend): where our own CUDA kernels run (``mx.fast.cuda_kernel``)."""
    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


def on_gpu() -> bool:
    """Any GPU: there a small model's cycle costs the host's graph building and kernel
    launches more than arithmetic, so the engine queues cycles ahead and attention reads
    fixed-size key buffers (one kernel shape per 256 positions). On the CPU the arithmetic
    is the cost and both only add work."""
    return mx.default_device() == mx.gpu
