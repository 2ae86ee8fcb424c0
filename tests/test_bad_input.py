"""Bad input, tried as a user would: every case ends in one clear line and exit code 2 (a 4xx
with an OpenAI-style body from the server), or in a right answer; never a traceback, never
a half-written file; the server keeps serving."""

import json
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tiny_models import load_tiny, tiny_pair_files

from mlx_dflash import generate
from mlx_dflash.cli import main
from mlx_dflash.generate import _continue_after
from mlx_dflash.server import Served, create_app

CONTEXT = 64  # the tiny target's max_position_embeddings: generation must stop there


@pytest.fixture(scope="module")
def pair(tiny_dir):
    return tiny_pair_files(tiny_dir / "bad-input", "qwen3", block_size=8, max_position_embeddings=CONTEXT)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty model cache: bad input must leave it untouched (no download, no leftovers)."""
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def one_error_line(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("mlx-dflash: error: ") and len(err.splitlines()) == 1, err
    return err


def _draft_with_config(tmp_path, pair, **changes):
    """A copy of the pair's draft with ``changes`` in its config.json (``__raw__``: the whole file)."""
    draft = Path(pair[1])
    bad = tmp_path / "bad-draft"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((draft / "model.safetensors").read_bytes())
    config = {**json.loads((draft / "config.json").read_text()), **changes}
    (bad / "config.json").write_text(json.dumps(changes.get("__raw__", config)))
    return str(bad)


@pytest.mark.parametrize("changes, words", [
    ({"__raw__": [1, 2]}, "must hold a JSON object"),
    ({"hidden_size": "abc"}, "hidden_size must be a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a positive number"),
    ({"dflash_config": {"mask_token_id": "x"}}, "mask_token_id"),
    ({"dflash_config": {"mask_token_id": 3, "target_layer_ids": "1,2"}}, "target_layer_ids"),
])
def test_malformed_draft_configs(pair, tmp_path, capsys, changes, words):
    model, _ = pair
    draft = _draft_with_config(tmp_path, pair, **changes)
    assert words in one_error_line(capsys, main(["generate", "--model", model, "--draft", draft]))


@pytest.mark.parametrize("flags, words", [
    (["--temp", "0.7", "--seed", "-1"], "seed must be in 0.."),
    (["--temp", "0.7", "--seed", str(2**70)], "seed must be in 0.."),
    (["--temp", "nan"], "temperature must be in"),
    (["--top-p", "nan"], "top_p must be in"),
    (["--block-size", "0"], "--block-size must be at least 1"),
    (["--block-size", "9"], "block size must be in 1..8"),
    (["--prompt", "caf\udce9"], "--prompt is not valid UTF-8 (byte e9"),  # (how Python hands over a Latin-1 é)
    (["--prompt", "x" * CONTEXT], f"does not fit the model's context of {CONTEXT} tokens"),
    (["--draft-window", "-1"], "draft window"),
    (["--tree-budget", "0"], "a tree budget must be in 1..1024, got 0"),
    (["--tree-budget", "4"], "tree budgets must be in 8..1024 (at least the block size"),
])
def test_bad_generate_arguments(pair, home, capsys, flags, words):
    model, draft = pair
    code = main(["generate", "--model", model, "--draft", draft, "--no-chat", *flags])
    assert words in one_error_line(capsys, code)
    assert not home.exists()


def test_generation_is_bounded_by_the_context(pair):
    """--max-tokens 10**12 runs to the end of the model's context and stops there."""
    model_dir, draft_dir = pair
    model, tokenizer = load_tiny(model_dir)
    tokenizer.eos_token_ids = set()
    from mlx_dflash import load_draft

    result = generate(model, tokenizer, "def fib(n):", load_draft(draft_dir), max_tokens=10**12)
    assert len(result.tokens) == CONTEXT - len("def fib(n):") and result.finish_reason == "length"


def test_a_model_without_a_shipped_draft_fails_before_any_download(pair, home, capsys):
    model, _ = pair
    assert "no draft ships for" in one_error_line(capsys, main(["generate", "--model", model]))
    assert "no draft ships for 'qwen2.5-coder-0.5b'" in one_error_line(
        capsys, main(["generate", "--model", "qwen2.5-coder-0.5b"]))
    assert not home.exists()


@pytest.mark.parametrize("flags, words", [
    (["--tree-budgets", "16", "-3"], "a tree budget must be in 1..1024, got -3"),
    (["--lengths", "0"], "--lengths must all be at least 1"),
])
def test_bad_bench_arguments_fail_before_loading(home, capsys, flags, words):
    assert words in one_error_line(capsys, main(["bench", "--model", "/no/such/model", *flags]))
    assert not home.exists()


def test_a_block_larger_than_the_drafts_fails_before_benchmarking(pair, capsys):
    model, draft = pair
    code = main(["bench", "--model", model, "--draft", draft, "--block-size", "9", "--prompts", "/no/such/prompts.jsonl"])
    assert "block size must be in 1..8 (the draft's), got 9" in one_error_line(capsys, code)


@pytest.mark.parametrize("flags, words", [
    (["--eval-every", "-1"], "--eval-every must be at least 0"),
    (["--eval-prompts", "-3"], "--eval-prompts must be at least 0"),
    (["--save-every", "-1"], "--save-every must be at least 0"),
    (["--time-budget", "-5"], "--time-budget must be a positive number"),
    (["--time-budget", "nan"], "--time-budget must be a positive number"),
    (["--kernel-lr-scale", "2"], "--kernel-lr-scale must be in"),
    (["--selector-lr-scale", "nan"], "--selector-lr-scale must be in"),
    (["--conv-taps", "-1"], "--conv-taps must be in 0..16, got -1"),
    (["--seed", "-1"], "--seed must be in 0.."),
    (["--intermediate-size", "0"], "--intermediate-size must be at least 1"),
])
def test_bad_train_arguments_fail_before_loading(tmp_path, capsys, flags, words):
    code = main(["train", "--model", "/no/such/model", "--data", str(tmp_path), "--out", str(tmp_path / "run"), *flags])
    assert words in one_error_line(capsys, code)


def test_completion_only_refuses_a_prompts_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Write a function.\n")
    code = main(["data", "--model", "/no/such/model", "--out", str(tmp_path / "d"), "--prompts", str(prompts),
                 "--completion-only"])
    assert "--completion-only chooses among the docstring prompts" in one_error_line(capsys, code)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("command", [["train", "--data", "x"], ["data"], ["bench"], ["quantize", "x"]])
def test_an_output_folder_that_is_a_file_fails_before_any_work(tmp_path, capsys, command):
    """(``bench`` writes its folder at the end of a long run: it must not fail there.)"""
    taken = tmp_path / "taken"
    taken.write_text("mine")
    for out in (taken, taken / "below"):
        args = [*command, str(out)] if command[0] == "quantize" else [*command, "--out", str(out)]
        assert f"{taken} is a file, not a folder" in one_error_line(capsys, main(args))
    assert taken.read_text() == "mine"


def test_a_replay_beyond_the_block_fails_with_one_line(tmp_path, capsys):
    code = main(["bench", "--scale", "tiny", "--replay-mean", "100", "--lengths", "8", "--out", str(tmp_path)])
    assert "a replay's mean acceptance must be in 1..16" in one_error_line(capsys, code)


def test_a_draft_as_the_model_or_a_model_without_its_tokenizer_fails_with_one_line(pair, tmp_path, capsys):
    model, draft = pair
    code = main(["generate", "--model", draft, "--draft", draft, "--prompt", "hi"])
    assert "is a DFlash draft, not a target model" in one_error_line(capsys, code)
    bare = Path(shutil.copytree(model, tmp_path / "no-tokenizer"))
    for file in bare.glob("tokenizer*"):
        file.unlink()
    code = main(["generate", "--model", str(bare), "--draft", draft, "--prompt", "hi"])
    assert "its tokenizer encodes no text" in one_error_line(capsys, code)


def test_serve_on_a_busy_port_fails_before_loading(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code = main(["serve", "--model", "/no/such/model", "--draft", "/no/such/draft", "--port", str(port)])
    assert "the port is in use" in one_error_line(capsys, code)


@pytest.mark.parametrize("size", ["lots", "-1G"])
def test_serve_refuses_a_bad_prefix_cache_size_before_loading(capsys, size):
    code = main(["serve", "--model", "/no/such/model", "--draft", "/no/such/draft", f"--prefix-cache-bytes={size}"])
    assert "byte count" in one_error_line(capsys, code)


@pytest.mark.parametrize("seconds", ["-0.1", "11", "nan"])
def test_serve_refuses_a_bad_stream_interval_before_loading(capsys, seconds):
    code = main(["serve", "--model", "/no/such/model", "--draft", "/no/such/draft", f"--stream-interval={seconds}"])
    assert "--stream-interval must be 0..10 seconds" in one_error_line(capsys, code)


def test_a_closed_pipe_is_not_an_error():
    run = subprocess.run(f"{sys.executable} -m mlx_dflash.cli models list | head -1", shell=True,
                         capture_output=True, text=True)
    assert run.stdout.startswith("cache: ") and "Traceback" not in run.stderr and "Error" not in run.stderr


def test_random_argument_combinations_end_cleanly(pair, home, capsys):
    """A fuzz over generate's flags: each run succeeds or says one line, exit code 2."""
    model, draft = pair
    choices = {
        "--max-tokens": ["-1", "0", "1", "5", str(10**12)],
        "--block-size": ["-3", "0", "1", "4", "8", "99"],
        "--temp": ["nan", "-1", "0", "0.7", "1e9", "inf"],
        "--top-p": ["-0.5", "0", "0.9", "2", "nan"],
        "--top-k": ["-1", "0", "1", "5"],
        "--min-p": ["-1", "0", "0.1", "3"],
        "--seed": ["-1", "0", "7", str(2**70)],
        "--repetition-penalty": ["-1", "0", "1.1"],
        "--draft-window": ["-1", "0", "4"],
        "--stop": ["", "x", "\udcff"],
        "--prompt": ["", "hi", "\udcff", "x" * 80],
    }
    rng = random.Random(0)
    outcomes = []
    for _ in range(40):
        flags = [x for flag in rng.sample(sorted(choices), 4) for x in (flag, rng.choice(choices[flag]))]
        code = main(["generate", "--model", model, "--draft", draft, "--no-chat", *flags])
        captured = capsys.readouterr()
        if code == 2:
            assert captured.err.startswith("mlx-dflash: error: ") and len(captured.err.strip().splitlines()) == 1
        else:
            assert code == 0 and "mean acceptance length" in captured.out, (flags, captured.err)
        outcomes.append(code)
    assert set(outcomes) == {0, 2}
    assert not home.exists()


# ---------------------------------------------------------------------------
# The server


@pytest.fixture(scope="module")
def client(pair):
    model_dir, draft_dir = pair
    model, tokenizer = load_tiny(model_dir)
    from mlx_dflash import load_draft

    draft = load_draft(draft_dir)
    with TestClient(create_app(Served(model, tokenizer, draft, "tiny", CONTEXT, 32))) as client:
        yield client, model, tokenizer, draft


def _is_openai_error(reply, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "temperature": 0.5, "seed": -1}, "seed"),
    ({"messages": USER, "temperature": 0.5, "seed": 2**70}, "seed"),
    ({"messages": USER, "temperature": 0.5, "seed": 2**70, "stream": True}, "seed"),
    ({"messages": USER, "top_k": -2}, "top_k"),
    ({"messages": USER, "min_p": 1.5}, "min_p"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 70}]}, "messages"),
])
def test_unsupported_or_malformed_requests_get_a_4xx(client, body, param):
    client, *_ = client
    assert _is_openai_error(client.post("/v1/chat/completions", json=body), 400)["param"] == param
    assert client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3}).status_code == 200


@pytest.mark.parametrize("raw, param", [
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ('{"prompt": "a\\udfff"}', "prompt"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": Infinity}', "max_tokens"),
])
def test_invalid_unicode_and_numbers_get_a_400(client, raw, param):
    client, *_ = client
    path = "/v1/completions" if "prompt" in raw else "/v1/chat/completions"
    reply = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert _is_openai_error(reply, 400)["param"] == param


def test_unknown_paths_and_methods_get_the_same_error_shape(client):
    client, *_ = client
    _is_openai_error(client.get("/v1/nothing"), 404)
    _is_openai_error(client.get("/v1/chat/completions"), 405)


def test_text_parts_are_joined_like_a_string(client):
    client, *_ = client
    parts = [{"role": "user", "content": [{"type": "text", "text": "def "}, {"type": "text", "text": "fib"}]}]
    plain = [{"role": "user", "content": "def fib"}]
    replies = [client.post("/v1/chat/completions", json={"messages": m, "max_tokens": 8}).json() for m in (parts, plain)]
    assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]


def test_a_completion_is_the_exact_continuation_of_its_prompt(client):
    """prompt text + completion text == the decoded prompt and output tokens (a leading
    space included), streamed or not."""
    client, model, tokenizer, draft = client
    for text in ["def fib(n):", "Hello", "a b c"]:
        prompt = tokenizer.encode(text)
        expected = generate(model, tokenizer, prompt, draft, max_tokens=12, continuation=True)
        assert tokenizer.decode(prompt) + expected.text == tokenizer.decode(prompt + expected.tokens)
        reply = client.post("/v1/completions", json={"prompt": text, "max_tokens": 12}).json()
        assert reply["choices"][0]["text"] == expected.text
        with client.stream("POST", "/v1/completions", json={"prompt": text, "max_tokens": 12, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text


def test_a_primed_detokenizer_keeps_the_first_tokens_leading_space(client):
    _, _, tokenizer, _ = client
    detokenizer = tokenizer.detokenizer
    for primed in (False, True):
        detokenizer.reset()
        if primed:
            import mlx.core as mx

            _continue_after(detokenizer, mx.array(tokenizer.encode("Hello")))
        start = len(detokenizer.text)
        for token in tokenizer.encode(" Zoom"):
            detokenizer.add_token(token)
        detokenizer.finalize()
        assert detokenizer.text[start:] == (" Zoom" if primed else "Zoom")


def test_request_fuzz_keeps_the_server_serving(client):
    """Random bodies built from valid and invalid pieces: a 200 or an OpenAI-style 4xx, every time."""
    client, *_ = client
    pieces = {
        "messages": [USER, [], "hi", [{"role": "robot", "content": "x"}], [{"role": "user"}]],
        "max_tokens": [1, 0, -5, 10**9, "8", 2.5, None, True],
        "temperature": [0, 0.5, -1, 3, "hot", None],
        "top_p": [0.5, 1, 2, None],
        "stop": ["x", ["a", "b"], 5, ["a"] * 5, None],
        "stream": [True, False, "yes", 1],
        "seed": [1, -1, 2**70, "s", None],
        "n": [1, 2, None],
        "model": ["tiny", "other"],
    }
    rng = random.Random(1)
    statuses = []
    for _ in range(60):
        body = {k: rng.choice(v) for k, v in pieces.items() if rng.random() < 0.6}
        reply = client.post("/v1/chat/completions", json=body)
        if reply.status_code != 200:
            _is_openai_error(reply, reply.status_code)
            assert 400 <= reply.status_code < 500
        statuses.append(reply.status_code)
    assert 200 in statuses and any(400 <= s < 500 for s in statuses)
    assert client.get("/health").json()["status"] == "ok"
