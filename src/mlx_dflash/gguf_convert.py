"""GGUF -> mlx-lm model folder: config, dequantized weights and a tokenizer, no torch.

llama.cpp stores tensors under its own names and, for llama, with the Q and K
rows permuted for its rotary layout; both are undone here. The tokenizer is
rebuilt from ``tokenizer.ggml.*`` metadata with the ``tokenizers`` library.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
from tqdm import tqdm

from .errors import DFlashError

# GGUF tensor name (after "blk.N.") -> mlx-lm name (after "model.layers.N.")
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GEMMA3_LAYER_NAMES = {  # gemma3 norms around attention and the MLP, plus per-head q/k norms
    **LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp pre-tokenizer name -> regex split (None: GPT-2's ByteLevel regex)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader) -> dict:
    """An mlx-lm/Hugging Face style config.json from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise DFlashError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    tensor_names = {t.name for t in reader.tensors}
    heads = _field(reader, f"{arch}.attention.head_count")
    config = {
        "model_type": "gemma3_text" if arch == "gemma3" else arch,
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": _field(reader, f"{arch}.embedding_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 4096),
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "gemma3":  # what the GGUF leaves out is Gemma 3's fixed design (mlx-lm's defaults)
        head_dim = _field(reader, "gemma3.attention.key_length", 256)
        config |= {"head_dim": head_dim, "query_pre_attn_scalar": head_dim, "rope_local_base_freq": 10000.0,
                   "sliding_window": _field(reader, "gemma3.attention.sliding_window", 512),
                   "sliding_window_pattern": 6}
    return {k: v for k, v in config.items() if v is not None}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved -> half-split rotary layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def mlx_name(gguf_name: str, arch: str = "llama") -> str:
    base, _, kind = gguf_name.rpartition(".")
    layer_names = GEMMA3_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
    if base.startswith("blk."):
        _, index, part = base.split(".", 2)
        if part not in layer_names:
            raise DFlashError(f"unexpected GGUF tensor {gguf_name}")
        return f"model.layers.{index}.{layer_names[part]}.{kind}"
    if base not in GLOBAL_NAMES:
        raise DFlashError(f"unexpected GGUF tensor {gguf_name}")
    return f"{GLOBAL_NAMES[base]}.{kind}"


def gguf_weights(reader, config: dict) -> dict[str, np.ndarray]:
    """All tensors dequantized to float32 under mlx-lm names."""
    from gguf import quants

    weights = {}
    for tensor in tqdm(reader.tensors, desc="dequantize", unit="tensor"):
        w = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(tensor.shape)])
        arch = _field(reader, "general.architecture")
        name = mlx_name(tensor.name, arch)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            w = _unpermute(w, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + weight); mlx-lm adds the 1 itself
        weights[name] = w
    return weights


def _byte_level_bpe(reader, tokens: list[str]):
    """GPT-2 style byte-level BPE (llama 3, qwen2, SmolLM): vocab + merges + a split regex."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre != "qwen2")
    if pre == "qwen2":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), byte_level])
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(reader, tokens: list[str], types: list[int]):
    """SentencePiece BPE (Gemma): merges rebuilt from the piece scores, byte fallback, '▁' for spaces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    scores = _field(reader, "tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, index in vocab.items():
        if types[index] != 1 or len(piece) < 2:  # only normal pieces are merge results
            continue
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(left, right, scores[index]) for left, right in sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]]))]
    merges.sort(key=lambda m: m[2], reverse=True)  # higher score merges first
    unk = tokens[_field(reader, "tokenizer.ggml.unknown_token_id", 0)]
    tok = Tokenizer(models.BPE(vocab, [(a, b) for a, b, _ in merges], unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    if _field(reader, "tokenizer.ggml.add_bos_token", False):
        bos = tokens[_field(reader, "tokenizer.ggml.bos_token_id")]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, vocab[bos])])
    return tok


def gguf_tokenizer(reader):
    """A transformers fast tokenizer rebuilt from the GGUF's vocabulary metadata (no torch)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    kind = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    if kind == "gpt2":
        tok = _byte_level_bpe(reader, tokens)
    elif kind == "llama":
        tok = _sentencepiece_bpe(reader, tokens, types)
    else:
        raise DFlashError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama)")
    # token types: 3 = control (special), 4 = user-defined (added, not special)
    tok.add_tokens([AddedToken(tokens[i], special=types[i] == 3, normalized=False)
                    for i in range(len(tokens)) if types[i] in (3, 4)])

    def token(key: str) -> Optional[str]:
        index = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=token("bos"), eos_token=token("eos"),
        unk_token=token("unknown"), pad_token=token("padding"),
    )
    template = _field(reader, "tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast


def _name_portable_tokenizer_class(config_path: Path) -> None:
    """transformers 5 names its fast tokenizers ``TokenizersBackend``, a class 4.x lacks;
    ``PreTrainedTokenizerFast`` reads the same tokenizer.json in both."""
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(path: Path, out: Path, dtype: str = "float32", bits: Optional[int] = None,
                 group_size: int = 64) -> Path:
    """Write an mlx-lm folder for the GGUF at ``path`` (optionally re-quantized to ``bits``)."""
    import mlx.core as mx
    from gguf import GGUFReader
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise DFlashError(f"{path} is not a readable GGUF file: {exc}") from None
    config = gguf_config(reader)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: mx.array(v).astype(getattr(mx, dtype)) for k, v in gguf_weights(reader, config).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gguf_tokenizer(reader).save_pretrained(str(out))
    _name_portable_tokenizer_class(out / "tokenizer_config.json")
    if bits:
        model, config = load_model(out)
        model, config = quantize_model(model, config, group_size, bits)
        (out / "model.safetensors").unlink()
        save_model(out, model)
        save_config(config, config_path=out / "config.json")
    return out
