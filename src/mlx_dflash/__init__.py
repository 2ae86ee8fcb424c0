"""mlx-dflash: DFlash block-diffusion speculative decoding for mlx-lm models."""

import os

# MLX's CUDA backend builds a cuDNN attention graph for every new (query length, key length)
# pair; a verify block or a draft pass meets a new key length every cycle, and each build
# costs tens of ms (BENCHMARKS.md, "MLX CUDA"). MLX's own attention kernels need no build.
# Read once by MLX, at its first attention call; set it to 1 yourself to keep cuDNN.
os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")

from .draft import DFlashDraft, create_random_draft, load_draft, save_draft
from .engine import GenerationResult, StreamResponse, generate, stream_generate
from .errors import DFlashError
from .target import Target, load_target

__version__ = "0.1.0"
__all__ = [
    "DFlashDraft", "DFlashError", "GenerationResult", "StreamResponse", "Target",
    "create_random_draft", "generate", "load_draft", "load_target", "save_draft", "stream_generate",
]
