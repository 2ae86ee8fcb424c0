"""The command line: a full run on tiny files, and one-line errors for bad input."""

import json

import pytest
from tiny_models import MASK_ID, tiny_pair_files

from mlx_dflash.cli import main


@pytest.fixture(scope="module")
def files(tiny_dir):
    return tiny_pair_files(tiny_dir / "cli", "qwen3")


def test_generate_streams_text_and_stats(files, capsys):
    target, draft = files
    code = main(["generate", "--model", target, "--draft", draft, "--prompt", "hi", "--max-tokens", "20", "--no-chat"])
    out = capsys.readouterr().out
    assert code == 0
    assert "decode" in out and "tok/s" in out and "mean acceptance length" in out


def test_chat_template_is_applied(files, capsys):
    target, draft = files
    assert main(["generate", "--model", target, "--draft", draft, "--prompt", "hi", "--max-tokens", "5", "--chat"]) == 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "/no/such/model"], "model not found"),
        (["--draft", "/no/such/draft"], "draft not found"),
        (["--max-tokens", "0"], "max-tokens"),
        (["--block-size", "99"], "block size"),
    ],
)
def test_bad_input_is_one_line(files, capsys, extra, message):
    target, draft = files
    args = ["generate", "--model", target, "--draft", draft, "--prompt", "x", *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_quantize_saves_a_loadable_smaller_draft(files, tmp_path, capsys):
    target, draft = files
    out = tmp_path / "draft-q4"
    assert main(["quantize", draft, str(out), "--bits", "4", "--group-size", "32"]) == 0
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    from pathlib import Path

    assert size(out) < size(Path(draft)) / 3
    assert json.loads((out / "config.json").read_text())["quantization"] == {"group_size": 32, "bits": 4}
    assert main(["generate", "--model", target, "--draft", str(out), "--prompt", "hi", "--max-tokens", "8"]) == 0
    assert main(["quantize", str(out), str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err


def test_draft_vocab_saves_a_draft_that_drafts_from_frequent_tokens(files, tmp_path, capsys):
    target, draft = files
    data = tmp_path / "data"
    data.mkdir()
    records = [{"id": i, "prompt_len": 2, "tokens": [1, 2] + [40 + i % 3] * 5 + [90]} for i in range(4)]
    (data / "sequences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "draft-vocab"
    assert main(["draft-vocab", draft, str(out), "--data", str(data), "--size", "3"]) == 0
    assert json.loads((out / "draft_vocab.json").read_text()) == [40, 41, 42]  # 90 is rarer: left out
    assert main(["generate", "--model", target, "--draft", str(out), "--prompt", "hi", "--max-tokens", "8"]) == 0
    assert main(["draft-vocab", draft, str(out), "--data", str(tmp_path / "none"), "--size", "3"]) == 2
    assert main(["draft-vocab", draft, str(out), "--data", str(data), "--size", "0"]) == 2
    assert "sequences.jsonl" in capsys.readouterr().err


def test_draft_quant_flag(files, capsys):
    target, draft = files
    assert main(["generate", "--model", target, "--draft", draft, "--prompt", "hi", "--max-tokens", "8",
                 "--draft-quant", "8"]) == 0


def test_data_prompt_sources_are_checked(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    out = str(tmp_path / "data")
    assert main(["data", "--out", out, "--prompts", str(prompts), "--prompt-packages", "tqdm"]) == 2
    assert main(["data", "--out", out, "--prompt-packages", "no_such_package"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "not both" in err[0] and "no_such_package" in err[1] and len(err) == 2


@pytest.mark.parametrize("preset", [None, "1"])
def test_import_sets_mlx_cuda_defaults_unless_set(preset):
    """MLX reads these once, at its first GPU use; importing mlx_dflash sets them unless the user did."""
    import os
    import subprocess
    import sys

    ours = ("MLX_ENABLE_CACHE_THRASHING_CHECK", "MLX_CUDA_USE_CUDNN_SDPA", "MLX_ENABLE_TF32")
    env = {k: v for k, v in os.environ.items() if k not in ours}
    if preset is not None:
        env["MLX_ENABLE_CACHE_THRASHING_CHECK"] = preset
    code = f"import os, mlx_dflash; print(*(os.environ[k] for k in {ours!r}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [preset or "0", "0", "0"]


def test_dequantize_exports_float_weights_in_the_published_format(files, tmp_path, capsys):
    """An 8-bit draft back to plain bfloat16 weights (what engines without quantized drafts read)."""
    import mlx.core as mx

    from mlx_dflash import load_draft
    from mlx_dflash.draft_io import is_quantized

    target, draft = files
    q8, out = tmp_path / "q8", tmp_path / "float"
    assert main(["quantize", draft, str(q8), "--bits", "8"]) == 0
    assert main(["dequantize", str(q8), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and config["dflash_config"]["mask_token_id"] == MASK_ID
    weights = mx.load(str(out / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in weights.values()) and not any(k.endswith("scales") for k in weights)
    plain, quantized = load_draft(str(out)), load_draft(str(q8))
    assert not is_quantized(plain)
    layer = quantized.layers[0].mlp.down_proj
    expected = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
    assert mx.allclose(plain.layers[0].mlp.down_proj.weight.astype(mx.float32), expected, rtol=1e-2, atol=1e-3).item()
    assert main(["generate", "--model", target, "--draft", str(out), "--prompt", "hi", "--max-tokens", "8"]) == 0
    capsys.readouterr()
    assert main(["dequantize", draft, str(tmp_path / "again")]) == 2
    assert "is not quantized" in capsys.readouterr().err
