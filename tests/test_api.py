"""The Python API as a newcomer uses it: one call loads a pair, chat prompts need no template
code, and the slow BLAS is named with its fix."""

import pytest
from tiny_models import MASK_ID, tiny_pair_files

import mlx_dflash
from mlx_dflash import blas, generate


@pytest.fixture(scope="module")
def files(tiny_dir):
    return tiny_pair_files(tiny_dir / "api", "llama")


def test_load_returns_a_checked_pair(files):
    target, draft = files
    model, tokenizer, loaded = mlx_dflash.load(target, draft, draft_quant=8)
    assert loaded.config.mask_token_id == MASK_ID and mlx_dflash.draft_io.is_quantized(loaded)
    with pytest.raises(mlx_dflash.DFlashError, match="no draft ships"):
        mlx_dflash.load(target)
    with pytest.raises(mlx_dflash.DFlashError, match="4 or 8 bits"):
        mlx_dflash.load(target, draft, draft_quant=3)


def test_chat_and_messages_use_the_chat_template(files):
    target, draft = files
    model, tokenizer, loaded = mlx_dflash.load(target, draft)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = generate(model, tokenizer, ids, loaded, max_tokens=12)
    assert generate(model, tokenizer, messages, loaded, max_tokens=12).tokens == expected.tokens
    user_only = tokenizer.apply_chat_template(messages[1:], add_generation_prompt=True)
    assert (generate(model, tokenizer, "hi", loaded, max_tokens=12, chat=True).tokens
            == generate(model, tokenizer, user_only, loaded, max_tokens=12).tokens)


def test_the_slow_blas_is_named_with_its_one_line_fix(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MLX_DFLASH_BLAS", raising=False)
    monkeypatch.setattr(blas, "_cpu_linux", lambda: True)
    monkeypatch.setattr(blas, "openblas_path", lambda: "/usr/lib/libblas.so.3")
    assert "mlx_dflash.use_fast_blas()" in blas.slow_blas_warning()
    monkeypatch.setattr(blas, "openblas_path", lambda: None)
    assert "apt-get install" in blas.slow_blas_warning()
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libblas.so.3")
    assert blas.slow_blas_warning() is None


def test_prefill_progress_is_reported_chunk_by_chunk(files):
    target, draft = files
    model, tokenizer, loaded = mlx_dflash.load(target, draft)
    seen = []
    prompt = list(range(3, 60))
    result = generate(model, tokenizer, prompt, loaded, max_tokens=4, prompt_progress=lambda *a: seen.append(a),
                      options=mlx_dflash.EngineOptions(prefill_step=16))
    assert seen == [(16, 57), (32, 57), (48, 57), (56, 57)] and len(result.tokens) == 4


def test_sampling_in_worker_threads_lets_the_process_exit_cleanly():
    """As the server samples: in worker threads, seeded or not. Each generation draws from its
    own keys (``sampling.Draws``); MLX's global random state, used from such threads, aborted
    the process at exit ("terminate called")."""
    import subprocess
    import sys

    code = ("from concurrent.futures import ThreadPoolExecutor\n"
            "import mlx.core as mx\n"
            "from mlx_dflash.sampling import SamplingParams, first_token, verify\n"
            "def draw(i):\n"
            "    params = SamplingParams(temp=1.0, seed=i if i % 2 else None).drawing()\n"
            "    logits = mx.random.normal((4, 16), key=mx.random.key(i))\n"
            "    first_token(params, logits[:1], mx.array([1]))\n"
            "    q = mx.softmax(logits[:3], axis=-1)\n"
            "    return verify(params, logits, None, mx.array([1, 2, 3, 4]), mx.array([2, 3, 4]), q)[1].item()\n"
            "print(sum(ThreadPoolExecutor(16).map(draw, range(64))))\n")
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]


def test_token_ids_outside_the_vocabulary_are_refused(files):
    """Ids past the embedding table read outside it (a segmentation fault); negative ones could
    not be converted. One clear error each, from generate and from a batch; numpy ids are fine."""
    import numpy as np

    from mlx_dflash.batch import batch_generate

    target, draft = files
    model, tokenizer, loaded = mlx_dflash.load(target, draft)
    vocab = model.args.vocab_size
    with pytest.raises(mlx_dflash.DFlashError, match=f"token id {vocab}, outside the target's vocabulary"):
        generate(model, tokenizer, [5, vocab], loaded, max_tokens=2)
    with pytest.raises(mlx_dflash.DFlashError, match="non-negative integers"):
        generate(model, tokenizer, [5, -1], loaded, max_tokens=2)
    with pytest.raises(mlx_dflash.DFlashError, match="outside the target's vocabulary"):
        batch_generate(model, [[5, 6], [vocab + 7]], loaded, [2, 2])
    assert (generate(model, tokenizer, np.array([5, 6, 7]), loaded, max_tokens=3).tokens
            == generate(model, tokenizer, [5, 6, 7], loaded, max_tokens=3).tokens)
