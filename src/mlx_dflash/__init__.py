"""mlx-dflash: DFlash block-diffusion speculative decoding for mlx-lm models."""

import os

# MLX's CUDA backend builds a cuDNN attention graph for every new (query length, key length)
# pair; a verify block or a draft pass meets a new key length every cycle, and each build
# costs tens of ms (BENCHMARKS.md, "MLX CUDA"). MLX's own attention kernels need no build.
# Read once by MLX, at its first attention call; set it to 1 yourself to keep cuDNN.
os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
# MLX's CUDA backend keeps LRU caches (CUDA graphs: 400 entries) whose check counts every miss
# in the process's life and throws once they pass twice the capacity, ending the process: a
# long `serve` (every prompt length, block size and 256-position buffer size makes new graphs)
# can die by it, mid-request. Without the check a miss only costs a rebuild.
# MLX 0.32.4 reads MLX_ENABLE_CACHE_THRASHING_CHECK (checked in its CUDA library's strings).
os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")
# MLX's CUDA backend runs float32 matmuls on TF32 tensor cores (10-bit mantissas) unless
# MLX_ENABLE_TF32=0: a verify block's matmuls (cuBLAS) then round far coarser than a one-token
# step's (MLX's own gemv), and float32 on a GPU stops being the exact path. H200, SmolLM2 in
# float32, x8 HumanEval 1,024: with TF32 7/8 and 6/8 continuations equal to mlx-lm's, without
# 8/8 and 8/8 (BENCHMARKS.md, eighteenth session). bf16 and quantized models are unaffected.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

from .blas import use_fast_blas
from .draft import DFlashDraft, create_random_draft
from .draft_io import load_draft, save_draft
from .generate import GenerationResult, StreamResponse, generate, stream_generate
from .options import EngineOptions
from .errors import DFlashError
from .pair import load
from .sampling import SamplingParams
from .target import Target, load_target

__version__ = "0.1.0"
__all__ = [
    "DFlashDraft", "DFlashError", "EngineOptions", "GenerationResult", "SamplingParams", "StreamResponse", "Target",
    "create_random_draft", "generate", "load", "load_draft", "load_target", "save_draft", "stream_generate",
    "use_fast_blas",
]
