"""mlx-dflash: DFlash block-diffusion speculative decoding for mlx-lm models."""

from .draft import DFlashDraft, create_random_draft, load_draft, save_draft
from .engine import GenerationResult, StreamResponse, generate, stream_generate
from .errors import DFlashError
from .target import Target, load_target

__version__ = "0.1.0"
__all__ = [
    "DFlashDraft", "DFlashError", "GenerationResult", "StreamResponse", "Target",
    "create_random_draft", "generate", "load_draft", "load_target", "save_draft", "stream_generate",
]
