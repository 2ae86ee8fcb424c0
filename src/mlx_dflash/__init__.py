"""mlx-dflash: DFlash block-diffusion speculative decoding for mlx-lm models."""

import os

# MLX CUDA defaults for DFlash, read by MLX at its first GPU use (set one yourself to keep MLX's);
# docs/performance.md gives the measurements behind them:
# - cuDNN attention builds a graph per key length, and a verify meets a new one every cycle;
os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
# - the CUDA graph cache's thrashing check ends a long-running server that meets many shapes;
os.environ.setdefault("MLX_ENABLE_CACHE_THRASHING_CHECK", "0")
# - TF32 matmuls round a verify's products far coarser than a one-token step's: float32 on a
#   GPU would stop being the exact path.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

from .blas import use_fast_blas
from .draft import DFlashDraft, create_random_draft
from .draft_io import load_draft, save_draft
from .generate import GenerationResult, StreamResponse, generate, stream_generate
from .options import EngineOptions
from .errors import DFlashError
from .pair import load
from .prefix_cache import PrefixCache
from .sampling import SamplingParams
from .target import Target, load_target

__version__ = "0.1.0"
__all__ = [
    "DFlashDraft", "DFlashError", "EngineOptions", "GenerationResult", "PrefixCache", "SamplingParams", "StreamResponse", "Target",
    "create_random_draft", "generate", "load", "load_draft", "load_target", "save_draft", "stream_generate",
    "use_fast_blas",
]
