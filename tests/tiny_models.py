"""Tiny random mlx-lm models with a byte-level tokenizer, built in-process for tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
VOCAB_SIZE = 256 + len(SPECIALS)
MASK_ID = VOCAB_SIZE - 1
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
FAMILIES = {
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "qwen2": {"model_type": "qwen2"},
    "llama": {"model_type": "llama"},
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True}
_GATED_DELTA = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 3,
                "head_dim": 16}
# Families beyond dense attention (tests/test_families.py); sliding windows of 8 so that
# rotating caches wrap many times within a test.
MORE_FAMILIES = {
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 16, **_MOE},
    "gemma3_text": {"model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 16,
                    "sliding_window": 8, "sliding_window_pattern": 3},
    "gpt_oss": {"model_type": "gpt_oss", "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 8},
    "qwen3_5": {"model_type": "qwen3_5", **_GATED_DELTA,
                "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", **_GATED_DELTA, **_MOE, "shared_expert_intermediate_size": 32,
                    "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    "qwen3_next": {"model_type": "qwen3_next", **_GATED_DELTA, **_MOE, "shared_expert_intermediate_size": 32,
                   "partial_rotary_factor": 0.5},
}


def write_byte_tokenizer(path: Path) -> None:
    """One token per byte plus chat specials: every string round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in SPECIALS:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def make_tiny_target(path: Path, family: str, tie: bool = True, seed: int = 0, **overrides) -> Path:
    """Write a random float32 model folder that ``mlx_lm.load`` reads."""
    import importlib

    config = {**BASE, **{**FAMILIES, **MORE_FAMILIES}[family], "tie_word_embeddings": tie, **overrides}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # Sharper random weights give confident, varied greedy outputs instead of near-ties;
    # random attention sinks (gpt-oss) instead of zeros.
    params = {k: (v * 3 if v.ndim == 2 else mx.random.normal(v.shape) if k.endswith("sinks") else v)
              for k, v in tree_flatten(model.parameters())}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(path)
    return path


def load_tiny(path: Path):
    return load(str(path))


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy tokens: what DFlash must reproduce."""
    from mlx_lm.generate import generate_step

    return [token for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def tiny_pair(path: Path, family: str, prompt_text: str, reference_tokens: int, **overrides):
    """(model, tokenizer with EOS off, prompt ids, greedy reference) for a fresh tiny target."""
    model, tokenizer = load_tiny(make_tiny_target(path, family, **overrides))
    tokenizer.eos_token_ids = set()
    prompt = tokenizer.encode(prompt_text)
    return model, tokenizer, prompt, greedy_reference(model, prompt, reference_tokens)


def tiny_pair_files(folder: Path, family: str, block_size: int = 16, taps: Optional[list[int]] = None,
                    **overrides) -> tuple[str, str]:
    """(model folder, draft folder): a tiny target and a random one-layer draft for it (tapping
    the target's layers ``taps``, by default the draft's own choice), on disk."""
    from mlx_dflash import create_random_draft, save_draft

    target = make_tiny_target(folder / "target", family, **overrides)
    config = json.loads((target / "config.json").read_text())
    draft = create_random_draft(config, num_layers=1, block_size=block_size, mask_token_id=MASK_ID,
                                target_layer_ids=taps)
    return str(target), str(save_draft(draft, folder / "draft"))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(base: str, seconds: float) -> None:
    """Poll ``base``/health until a server answers (or ``seconds`` pass)."""
    import time

    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
