"""A DFlash draft's configuration: the fields of a published draft ``config.json`` that the
model uses, checked field by field (one clear line for a config a model cannot be built from),
and written back with the fields it does not use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import DFlashError


def default_target_layer_ids(num_target_layers: int, num_draft_inputs: int) -> list[int]:
    """Target layers tapped when a checkpoint does not list them (the reference rule).

    One tap: the middle layer. Otherwise evenly spread from layer 1 to layer L-3,
    e.g. L=36, K=5 -> [1, 9, 17, 25, 33].
    """
    if num_draft_inputs == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + j * span / (num_draft_inputs - 1)) for j in range(num_draft_inputs)]


POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "num_target_layers", "num_key_value_heads", "head_dim", "max_position_embeddings", "block_size",
                 "sliding_window")
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta", "input_embedding_scale", "output_multiplier",
                    "final_logit_softcapping")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_config_values(raw: dict, dflash: dict) -> None:
    """One line naming the first field of a draft config that a model cannot be built from."""
    for key in POSITIVE_INTS:
        value = raw.get(key)
        if value is not None and not (_is_int(value) and value > 0):
            raise DFlashError(f"draft config.json: {key} must be a positive integer, got {value!r}")
    for key in POSITIVE_NUMBERS:
        value = raw.get(key)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise DFlashError(f"draft config.json: {key} must be a positive number, got {value!r}")
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    if heads % kv_heads:
        raise DFlashError(f"draft config.json: num_attention_heads ({heads}) is not a multiple of "
                          f"num_key_value_heads ({kv_heads})")
    if not raw.get("head_dim") and raw["hidden_size"] % heads:
        raise DFlashError(f"draft config.json: hidden_size ({raw['hidden_size']}) is not a multiple of "
                          f"num_attention_heads ({heads}) and no head_dim is given")
    if not _is_int(dflash["mask_token_id"]) or dflash["mask_token_id"] < 0:
        raise DFlashError(f"draft config.json: dflash_config.mask_token_id must be a token id, got "
                          f"{dflash['mask_token_id']!r}")
    ids = dflash.get("target_layer_ids")
    if ids is not None and not (isinstance(ids, list) and ids and all(_is_int(i) and i >= 0 for i in ids)):
        raise DFlashError(f"draft config.json: dflash_config.target_layer_ids must be a list of layer indices, got {ids!r}")
    if raw.get("is_causal") is not None and not isinstance(raw["is_causal"], bool):
        raise DFlashError(f"draft config.json: is_causal must be true or false, got {raw['is_causal']!r}")
    for key in ("block_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if dflash.get(key) is not None and not (_is_int(dflash[key]) and dflash[key] > 0):
            raise DFlashError(f"draft config.json: dflash_config.{key} must be a positive integer, got {dflash[key]!r}")
    for key in ("context_window", "context_sink", "conv_kernel_size"):  # (0 taps: no convolutions)
        if dflash.get(key) is not None and not (_is_int(dflash[key]) and dflash[key] >= 0):
            raise DFlashError(f"draft config.json: dflash_config.{key} must be a count, got {dflash[key]!r}")
    types = raw.get("layer_types")
    if types is not None and not (isinstance(types, list) and len(types) == raw["num_hidden_layers"]):
        raise DFlashError("draft config.json: layer_types must list one type per layer")
    if raw.get("rope_scaling") is not None and not isinstance(raw["rope_scaling"], dict):
        raise DFlashError("draft config.json: rope_scaling must be an object")


@dataclass
class DraftConfig:
    """The fields of a published draft ``config.json`` that the model uses."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    rope_scaling: Optional[dict] = None
    layer_types: Optional[list[str]] = None
    sliding_window: Optional[int] = None
    # Draft context window (our extension, in dflash_config): attend to the first
    # ``context_sink`` and the last ``context_window`` committed positions only. None: all.
    context_window: Optional[int] = None
    context_sink: int = 4
    # Draft vocabulary (our extension, in draft_vocab.json): the token ids greedy drafts are
    # chosen from, e.g. the 8,192 most frequent in the training responses. None: all.
    draft_vocab: Optional[list[int]] = None
    # Sliding-window layers are causal unless the config says ``is_causal: false`` (DFlash2's are
    # not: a two-sided window over a non-causal block). None: not said (causal).
    is_causal: Optional[bool] = None
    # Optional scales (both versions): raw embeddings times ``input_embedding_scale``; logits times
    # ``output_multiplier``, then tanh-capped at ``final_logit_softcapping``.
    input_embedding_scale: Optional[float] = None
    output_multiplier: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    dflash2: Optional["DFlash2Config"] = None  # a DFlash2 draft's extra parts; None: v1
    extra: dict = field(default_factory=dict)  # unknown fields, written back on save

    @classmethod
    def from_dict(cls, raw: dict) -> "DraftConfig":
        if not isinstance(raw, dict):
            raise DFlashError(f"draft config.json must hold a JSON object, not a {type(raw).__name__}")
        raw = dict(raw)
        dflash = raw.pop("dflash_config", None) or {}
        if not isinstance(dflash, dict):
            raise DFlashError("draft config.json: dflash_config must be an object")
        required = [
            "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "vocab_size", "num_target_layers",
        ]
        missing = [k for k in required if k not in raw]
        if "mask_token_id" not in dflash:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise DFlashError(f"draft config.json lacks {', '.join(missing)}")
        _check_config_values(raw, dflash)
        heads = raw["num_attention_heads"]
        layer_ids = dflash.get("target_layer_ids") or default_target_layer_ids(
            raw["num_target_layers"], raw["num_hidden_layers"]
        )
        known = {
            "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "vocab_size", "max_position_embeddings", "block_size",
            "num_target_layers", "rope_scaling", "layer_types", "sliding_window", "architectures",
            "is_causal", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
        }
        v2 = DFlash2Config.from_dicts(raw, dflash)
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", 1_000_000.0),
            vocab_size=raw["vocab_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 40960),
            block_size=dflash.get("block_size") or raw.get("block_size", 16),  # (dflash_config's first)
            num_target_layers=raw["num_target_layers"],
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=[int(i) for i in layer_ids],
            rope_scaling=raw.get("rope_scaling"),
            layer_types=raw.get("layer_types"),
            sliding_window=raw.get("sliding_window"),
            context_window=dflash.get("context_window"),
            context_sink=dflash.get("context_sink", 4),
            is_causal=raw.get("is_causal"),
            input_embedding_scale=raw.get("input_embedding_scale"),
            output_multiplier=raw.get("output_multiplier"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            dflash2=v2,
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_dict(self) -> dict:
        out = dict(self.extra)
        out.update(
            {
                "architectures": ["DFlash2DraftModel" if self.dflash2 else "DFlashDraftModel"],
                "model_type": out.get("model_type", "qwen3"),
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling,
                "vocab_size": self.vocab_size,
                "max_position_embeddings": self.max_position_embeddings,
                "block_size": self.block_size,
                "num_target_layers": self.num_target_layers,
                "dflash_config": {
                    "mask_token_id": self.mask_token_id,
                    "target_layer_ids": self.target_layer_ids,
                },
            }
        )
        if self.context_window is not None:
            out["dflash_config"].update(context_window=self.context_window, context_sink=self.context_sink)
        if self.layer_types is not None:
            out["layer_types"] = self.layer_types
            out["sliding_window"] = self.sliding_window
        if self.dflash2 is not None:
            out["dflash_config"].update(self.dflash2.to_dict(), block_size=self.block_size)
        optional = {"is_causal": self.is_causal, "input_embedding_scale": self.input_embedding_scale,
                    "output_multiplier": self.output_multiplier, "final_logit_softcapping": self.final_logit_softcapping}
        out.update({k: v for k, v in optional.items() if v is not None})
        return out

    @property
    def causal_windows(self) -> bool:
        """Whether sliding-window layers are causal (v1's rule), rather than a two-sided window
        over a non-causal block (``is_causal: false``)."""
        return self.is_causal is not False

    def is_sliding(self, layer_index: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer_index] == "sliding_attention"


V2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlash2Config:
    """DFlash2's additions (``dflash_config``): a per-token convolution around each sublayer
    (``conv_kernel_size`` taps, kernels projected per group of ``conv_group_size`` channels) and a
    low-rank candidate selector re-ranking the head's top ``selector_top_k`` by the previous token.
    ``conv_kernel_size`` 0 (ours, not the published format's): no convolutions, v1's layers and
    the selector (where we trained both, the convolutions added no acceptance: docs/training.md)."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    @classmethod
    def from_dicts(cls, raw: dict, dflash: dict) -> Optional["DFlash2Config"]:
        """The v2 part of a config, or None for a v1 draft (told apart by ``architectures`` and
        the v2 keys)."""
        architectures = raw.get("architectures") or []
        if "DFlash2DraftModel" not in architectures and not any(k in dflash for k in V2_KEYS):
            return None
        config = cls(**{k: dflash[k] for k in V2_KEYS if dflash.get(k) is not None})  # (checked by _check_config_values)
        if raw["hidden_size"] % config.conv_group_size:
            raise DFlashError(f"draft config.json: hidden_size ({raw['hidden_size']}) is not a multiple of "
                              f"dflash_config.conv_group_size ({config.conv_group_size})")
        return config

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in V2_KEYS}
