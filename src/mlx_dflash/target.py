"""The target model seen by the engine: logits plus the hidden states the draft needs.

We do not re-implement any model's forward. Instead the chosen decoder layers of
ONE model instance are wrapped (``TappedLayer``) so that the model's own
``__call__`` -- masks, sliding windows, softcapping and all -- runs unchanged
while the wrapped layers record their outputs. No mlx-lm class is patched.

Rollback after a partially accepted block is family specific; families that
need more than trimming attention caches plug in through ``SUPPORTED_FAMILIES``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .draft import DFlashDraft
from .errors import DFlashError

# model_type -> how to roll back its cache. Dense attention only for now.
SUPPORTED_FAMILIES = {"qwen3": "trim", "qwen2": "trim", "llama": "trim"}


class _Recorder:
    """Where tapped layers put their outputs; only records while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.outputs: dict[int, mx.array] = {}


class TappedLayer(nn.Module):
    """Wraps one decoder layer instance and records its output hidden state."""

    def __init__(self, layer: nn.Module, index: int, recorder: _Recorder):
        super().__init__()
        self.layer = layer
        self.index = index
        self.recorder = recorder  # a plain object, so not part of the parameters

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        if self.recorder.active:
            self.recorder.outputs[self.index] = out
        return out

    def __getattr__(self, name: str) -> Any:
        # Model forwards read attributes of their layers (e.g. llama's ``use_sliding``).
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)


def _model_type(model: nn.Module) -> str:
    return getattr(model, "model_type", None) or getattr(model.args, "model_type", "?")


class Target:
    """An mlx-lm model with taps on ``layer_ids``; ``__call__`` returns (logits, features)."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        family = _model_type(model)
        if family not in SUPPORTED_FAMILIES:
            supported = ", ".join(sorted(SUPPORTED_FAMILIES))
            raise DFlashError(f"target family {family!r} is not supported yet (supported: {supported})")
        self.model = model
        self.family = family
        self.layer_ids = list(layer_ids)
        self.recorder = _Recorder()
        self._install_taps()

    # -- structure -------------------------------------------------------
    @property
    def args(self):
        return self.model.args

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def _layer_list(self) -> list:
        """The stored list of decoder layers (``model.layers`` may be a fresh slice of it)."""
        inner = getattr(self.model, "model", None)
        return inner.layers if isinstance(getattr(inner, "layers", None), list) else self.model.layers

    def _install_taps(self) -> None:
        layers = self._layer_list()
        tapped = {i: layer for i, layer in enumerate(layers) if isinstance(layer, TappedLayer)}
        if tapped and set(tapped) == set(self.layer_ids):  # same taps already in place: share them
            self.recorder = next(iter(tapped.values())).recorder
            return
        for i, layer in tapped.items():  # different taps of an earlier Target: undo them
            layers[i] = layer.layer
        for i in self.layer_ids:
            if not 0 <= i < len(layers):
                raise DFlashError(f"target layer id {i} is out of range (target has {len(layers)} layers)")
            layers[i] = TappedLayer(layers[i], i, self.recorder)
        if not all(isinstance(self.model.layers[i], TappedLayer) for i in self.layer_ids):
            raise DFlashError(f"cannot tap layers of a {self.family} model: its layer list is not mutable")

    # -- pieces the draft borrows -----------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.model.embed_tokens(tokens)

    def head(self, hidden: mx.array) -> mx.array:
        """Logits from final-normed hidden states (tied or untied output head)."""
        if getattr(self.args, "tie_word_embeddings", False) or not hasattr(self.model, "lm_head"):
            return self.model.model.embed_tokens.as_linear(hidden)
        return self.model.lm_head(hidden)

    # -- forward and cache ----------------------------------------------
    def make_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def __call__(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """Logits [B, L, V] and tapped features [B, L, K*H] (in ``layer_ids`` order)."""
        self.recorder.active = True
        try:
            logits = self.model(tokens, cache=cache)
            tapped = [self.recorder.outputs[i] for i in self.layer_ids]
            features = mx.concatenate(tapped, axis=-1) if tapped else mx.zeros((*tokens.shape, 0))
        finally:
            self.recorder.active = False
            self.recorder.outputs = {}
        return logits, features

    def rollback(self, cache: list[Any], num_tokens: int) -> None:
        """Drop the last ``num_tokens`` positions (rejected draft tokens) from every layer."""
        if num_tokens == 0:
            return
        for layer_cache in cache:
            trimmed = layer_cache.trim(num_tokens)
            if trimmed != num_tokens:
                raise RuntimeError(f"cache trimmed {trimmed} of {num_tokens} tokens")


def float_dtype(model: nn.Module):
    """The dtype the draft should run in next to ``model``: its embedding's float dtype
    (float32 on the CPU, where bfloat16 bypasses BLAS); None for a quantized embedding."""
    embed = model.model.embed_tokens
    return None if hasattr(embed, "scales") else embed.weight.dtype


def check_compatible(draft: DFlashDraft, target: nn.Module) -> None:
    """Fail with one clear line when a draft was not made for this target."""
    config = draft.config
    args = target.args
    problems = []
    if config.hidden_size != args.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != target's {args.hidden_size}")
    if config.num_target_layers != len(target.layers):
        problems.append(f"draft expects {config.num_target_layers} target layers, target has {len(target.layers)}")
    if config.vocab_size != args.vocab_size:
        problems.append(f"vocab size {config.vocab_size} != target's {args.vocab_size}")
    if not 0 <= config.mask_token_id < args.vocab_size:
        problems.append(f"mask token id {config.mask_token_id} is outside the target vocab (0..{args.vocab_size - 1})")
    bad_ids = [i for i in config.target_layer_ids if not 0 <= i < len(target.layers)]
    if bad_ids:
        problems.append(f"target_layer_ids {bad_ids} out of range for {len(target.layers)} layers")
    if problems:
        raise DFlashError("draft does not match target: " + "; ".join(problems))


def load_target(path_or_repo: str):
    """Load an mlx-lm model and tokenizer (local folder or Hugging Face id), with one-line errors."""
    from mlx_lm.utils import load

    from .models import resolve

    path_or_repo = resolve(path_or_repo)  # a registered name (e.g. smollm2-135m) -> its folder
    local = Path(path_or_repo).expanduser()
    looks_local = path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1
    if looks_local and not local.exists():
        raise DFlashError(f"model not found: {path_or_repo}")
    try:
        return load(str(local) if local.exists() else path_or_repo)
    except Exception as exc:  # mlx-lm raises many types; the user needs the message, not the stack
        raise DFlashError(f"cannot load model {path_or_repo!r}: {exc}") from None
