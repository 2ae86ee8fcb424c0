"""A target sharded over two processes (mlx.launch, ring backend on this host): every shardable
family's greedy tokens equal the single-process run's (mlx-lm's greedy) on every path, both
processes commit the same tokens, sampled too (one shared seed), the CLI prints once with the
sharding in its stats line, and a family mlx-lm cannot shard fails with one line. Qwen3-Next is
pipelined (each process runs half of the layers, the draft's taps on both halves); the others
are tensor-parallel."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import launch, run_launch
from tiny_models import free_port, greedy_reference, load_tiny, tiny_pair_files, wait_until_healthy

from sharded_worker import MAX_TOKENS, PATHS, PROMPT

SHARDED = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "gpt_oss", "qwen3_next"]


@pytest.fixture(scope="module")
def sharded_runs(tiny_dir):
    folders = {family: tiny_dir / f"sharded-{family}" for family in SHARDED}
    for family, folder in folders.items():
        taps = [1, 4] if family == "qwen3_next" else None  # (pipelined: a tap in each process's layers)
        tiny_pair_files(folder, family, block_size=8, taps=taps, tie=family != "qwen3_5")  # (qwen3_5: its head sharded too)
    layers = json.loads((folders["qwen3_next"] / "target" / "config.json").read_text())["num_hidden_layers"]
    assert 1 < layers // 2 <= 4 < layers  # (process 1 runs the first half of the layers, process 0 the rest)
    out = tiny_dir / "sharded-out"
    out.mkdir()
    run = run_launch([sys.executable, str(Path(__file__).parent / "sharded_worker.py"), str(out),
                      *map(str, folders.values())], timeout=600)
    files = [out / f"process-{rank}.json" for rank in (0, 1)]
    assert all(f.is_file() for f in files), run.stdout[-3000:] + run.stderr[-3000:]
    return folders, [json.loads(f.read_text()) for f in files]


@pytest.mark.parametrize("family", SHARDED)
def test_sharded_tokens_equal_the_single_process_greedy_tokens(sharded_runs, family):
    folders, processes = sharded_runs
    assert [p["size"] for p in processes] == [2, 2]
    model, tokenizer = load_tiny(folders[family] / "target")
    reference = greedy_reference(model, tokenizer.encode(PROMPT), MAX_TOKENS)
    runs = [p["runs"][str(folders[family])] for p in processes]
    assert runs[0] == runs[1]  # (the same decisions in both processes, sampling included)
    for path in PATHS:
        if path != "sampled":
            assert runs[0][path] == reference, path
    assert len(runs[0]["sampled"]) == MAX_TOKENS


def test_cli_prints_once_and_names_the_sharding(sharded_runs):
    folders, _ = sharded_runs
    folder = folders["qwen3_next"]
    run = run_launch([sys.executable, "-m", "mlx_dflash.cli", "generate", "--model", str(folder / "target"),
                      "--draft", str(folder / "draft"), "--prompt", PROMPT, "--no-chat", "--max-tokens", "8"], timeout=300)
    assert run.stdout.count("pipeline-parallel over 2 processes") == 1, run.stdout + run.stderr


def test_a_family_mlx_lm_cannot_shard_fails_with_one_line(tiny_dir):
    target, draft = tiny_pair_files(tiny_dir / "sharded-gemma", "gemma3_text")
    run = run_launch([sys.executable, "-m", "mlx_dflash.cli", "generate", "--model", target,
                      "--draft", draft, "--prompt", PROMPT, "--no-chat", "--max-tokens", "4"], timeout=300)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "error" in line]
    assert len(lines) == 1 and "a gemma3_text target cannot be sharded over 2 processes" in lines[0], run.stderr


@pytest.mark.parametrize("family, sharding", [("qwen3", "tensor"), ("qwen3_next", "pipeline")])
def test_serve_sharded_answers_as_a_single_process_does(sharded_runs, family, sharding):
    """Requests through the real server (process 0 serves, process 1 follows), greedy and then
    sampled with a seed, each equal to a single-process generation; Ctrl-C ends every process."""
    import signal

    from openai import OpenAI

    from mlx_dflash import SamplingParams, generate, load

    folders, _ = sharded_runs
    folder = folders[family]
    port = free_port()
    server = subprocess.Popen(launch([sys.executable, "-m", "mlx_dflash.cli", "serve", "--model", str(folder / "target"),
                                      "--draft", str(folder / "draft"), "--port", str(port)]),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, 120)
        client = OpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0)
        model, tokenizer, draft = load(str(folder / "target"), str(folder / "draft"))
        for sampling in (None, SamplingParams(temp=0.8, seed=3)):
            extra = {} if sampling is None else {"temperature": 0.8, "seed": 3}
            answer = client.completions.create(model=str(folder / "target"), prompt=PROMPT, max_tokens=10, **extra)
            alone = generate(model, tokenizer, PROMPT, draft, max_tokens=10, sampling=sampling, continuation=True)
            assert answer.choices[0].text == alone.text
        stream = client.completions.create(model=str(folder / "target"), prompt=PROMPT, max_tokens=40, stream=True)
        next(iter(stream))  # (Ctrl-C mid-generation: every process is inside the same cycle's collectives)
    finally:  # Ctrl-C to every process of the launch, but not to mlx.launch itself: a KeyboardInterrupt
        # inside one of its queue calls can leave a lock held and the launcher waiting forever
        children = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
        for pid in children:
            os.kill(int(pid), signal.SIGINT)
        try:
            output, ended = server.communicate(timeout=60)[0], True
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            output, ended = server.communicate()[0], False
    assert ended, "Ctrl-C left the launch running: " + output[-3000:]
    assert f"{sharding}-parallel over 2 processes" in output, output[-3000:]
    # (the launcher may return before its processes have ended: process 0 finishes the reply in flight
    # and tells the other to stop; both must then end by themselves)
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "a process of the launch outlived it by 30 s"
        time.sleep(0.5)
