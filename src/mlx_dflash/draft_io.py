"""DFlash drafts on disk, in the published format: ``config.json`` + ``*.safetensors`` with no
key prefix, so drafts trained elsewhere load here and drafts saved here load in SGLang and
vLLM; plus our optional ``draft_vocab.json`` and 4/8-bit storage."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .device import on_apple_gpu
from .draft import DFlashDraft
from .draft_config import DraftConfig
from .errors import DFlashError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # names the shards of a draft saved in several files
DRAFT_VOCAB_FILE = "draft_vocab.json"
MAX_FILE_BYTES = 20_000_000  # larger drafts are saved in shards (a package keeps each file small)
CODEBOOK = "_codebook"  # DFlash2's selector tables: published with no ``.weight`` suffix (unless quantized, ours)


def _from_disk(name: str) -> str:
    return f"{name}.weight" if name.endswith(CODEBOOK) else name


def _to_disk(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The published names: a float codebook's ``X_codebook.weight`` is stored as ``X_codebook``."""
    def name(key: str) -> str:
        table = key.removesuffix(".weight")
        return table if table.endswith(CODEBOOK) and f"{table}.scales" not in weights else key
    return {name(key): value for key, value in weights.items()}


def _resolve_path(path_or_repo: str) -> Path:
    """A local folder, or a Hugging Face repo id resolved the way mlx-lm does."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    if path_or_repo.count("/") != 1 or path_or_repo.startswith((".", "/", "~")):
        raise DFlashError(f"draft not found: {path_or_repo}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path_or_repo, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # offline, unknown repo, auth: all one message for the user
        raise DFlashError(f"draft {path_or_repo!r} is not a local folder and could not be fetched: {exc}") from None


def load_draft(path_or_repo: str, dtype: Optional[mx.Dtype] = None) -> DFlashDraft:
    """Load a draft in the published format; every failure is a one-line DFlashError."""
    path = _resolve_path(path_or_repo)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise DFlashError(f"{path} has no {CONFIG_FILE}: not a DFlash draft folder")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DFlashError(f"{config_path} is not valid JSON: {exc}") from None
    config = DraftConfig.from_dict(raw)
    config.draft_vocab = _read_draft_vocab(path, config.vocab_size)
    weight_files = _weight_files(path)
    if not weight_files:
        raise DFlashError(f"{path} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in weight_files:
        try:
            weights.update((_from_disk(name), value) for name, value in mx.load(str(file)).items())
        except Exception as exc:
            raise DFlashError(f"cannot read draft weights {file}: {exc}") from None
    draft = DFlashDraft(config)
    quantization = raw.get("quantization")
    if quantization:
        quantize_draft(draft, quantization["bits"], quantization["group_size"])
    try:
        draft.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise DFlashError(f"draft weights in {path} do not match its config: {exc}") from None
    if quantization and dtype is not None and not on_apple_gpu():
        return dequantize_draft(draft, dtype)
    if dtype is not None and not quantization:
        draft.set_dtype(dtype)
    mx.eval(draft.parameters())
    return draft


def _weight_files(path: Path) -> list[Path]:
    """The files an index names (a sharded draft), else every ``*.safetensors`` in the folder."""
    index = path / INDEX_FILE
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise DFlashError(f"{index} is not a safetensors index: {exc!r}") from None
    missing = [name for name in names if not (path / name).is_file()]
    if missing:
        raise DFlashError(f"{index} names weight files that are missing: {', '.join(missing)}")
    return [path / name for name in names]


def _shards(weights: dict[str, mx.array], max_bytes: int) -> list[dict[str, mx.array]]:
    """Consecutive groups of at most ``max_bytes`` (a larger tensor gets a group of its own).
    (mlx-lm's ``make_shards`` does this in whole gigabytes; a packaged draft's files are MBs.)"""
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for name, value in weights.items():
        if shards[-1] and size + value.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    return shards


def dequantize_draft(draft: DFlashDraft, dtype: mx.Dtype) -> DFlashDraft:
    """A float copy of a quantized draft: the file stays small, the compute stays fast. Used
    everywhere but on Apple GPUs: on the CPU MLX's quantized matmul on a block is slower than
    float32 BLAS, and on CUDA MLX compiles a quantized-matmul kernel the first time it meets each
    class of row counts, a stall of many seconds mid-generation (docs/performance.md)."""
    weights = dict(tree_flatten(draft.parameters()))
    for name, module in draft.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            for part in ("weight", "scales", "biases"):
                weights.pop(f"{name}.{part}", None)
            weights[f"{name}.weight"] = mx.dequantize(module.weight, module.scales, module.biases,
                                                      module.group_size, module.bits)
    extra = {k: v for k, v in draft.config.extra.items() if k != "quantization"}
    plain = DFlashDraft(replace(draft.config, extra=extra))
    plain.load_weights(list(weights.items()), strict=True)
    plain.set_dtype(dtype)
    mx.eval(plain.parameters())
    return plain


def is_quantized(draft: DFlashDraft) -> bool:
    return any(isinstance(m, nn.QuantizedLinear) for _, m in draft.named_modules())


def quantize_draft(draft: DFlashDraft, bits: int, group_size: int = 64) -> None:
    """Quantize the draft's linear layers in place, and a DFlash2 selector's codebooks where
    their rank is whole groups (its norms and convolutions' base kernels stay in float)."""
    if is_quantized(draft):
        raise DFlashError("this draft is already quantized")

    def quantizable(_, module: nn.Module) -> bool:
        return isinstance(module, nn.Linear) or (
            isinstance(module, nn.Embedding) and module.weight.shape[-1] % group_size == 0)
    nn.quantize(draft, group_size=group_size, bits=bits, class_predicate=quantizable)
    draft.config.extra["quantization"] = {"group_size": group_size, "bits": bits}


def save_draft(draft: DFlashDraft, path: str | Path, max_file_bytes: int = MAX_FILE_BYTES) -> Path:
    """Write ``config.json`` and ``model.safetensors`` in the published layout; weights over
    ``max_file_bytes`` go to ``model-0000i-of-0000n.safetensors`` shards with an index (the
    Hugging Face layout)."""
    path = Path(path)
    vocab_file = path / DRAFT_VOCAB_FILE
    if draft.config.draft_vocab:
        check_draft_vocab(draft.config.draft_vocab, draft.config.vocab_size, vocab_file)
    path.mkdir(parents=True, exist_ok=True)
    # each file is written beside the folder and moved in whole: an interrupted save (or one
    # over the draft it was loaded from) never leaves a half-written file
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}-") as tmp:
        staged = Path(tmp)
        weights = _to_disk(dict(tree_flatten(draft.parameters())))
        shards = _shards(weights, max_file_bytes)
        names = [WEIGHTS_FILE] if len(shards) == 1 else [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        for name, shard in zip(names, shards):
            mx.save_safetensors(str(staged / name), shard, metadata={"format": "mlx"})
        (staged / CONFIG_FILE).write_text(json.dumps(draft.config.to_dict(), indent=2) + "\n")
        if draft.config.draft_vocab:
            (staged / DRAFT_VOCAB_FILE).write_text(json.dumps(draft.config.draft_vocab) + "\n")
        elif vocab_file.exists():
            vocab_file.unlink()
        if len(shards) > 1:
            weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
            index = {"metadata": {"total_size": sum(value.nbytes for value in weights.values())},
                     "weight_map": weight_map}
            (staged / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        # the index last and stale weight files after: a draft read mid-save is the old one or
        # fails with a clear error, never a mix
        files = sorted(staged.iterdir(), key=lambda f: f.name == INDEX_FILE)
        written = {file.name for file in files}
        for file in files:
            os.replace(file, path / file.name)
        for file in [*path.glob("*.safetensors"), path / INDEX_FILE]:
            if file.name not in written and file.exists():
                file.unlink()
    return path


def _read_draft_vocab(path: Path, vocab_size: int) -> Optional[list[int]]:
    file = path / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    try:
        ids = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DFlashError(f"{file} is not valid JSON: {exc}") from None
    check_draft_vocab(ids, vocab_size, file)
    return ids


def check_draft_vocab(ids, vocab_size: int, file: Path) -> None:
    """The one rule for a draft vocabulary, on reading and on writing it."""
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)
            and len(set(ids)) == len(ids)):
        raise DFlashError(f"{file} must be a non-empty list of distinct token ids in 0..{vocab_size - 1}"
                          " (token ids of this draft's target)")
