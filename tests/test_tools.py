"""The maintained profiling tools in tools/ and the benchmark scripts in benchmarks/ run (a smoke
test each, on a tiny pair) and explain themselves."""

import ast
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from launch import run_launch
from tiny_models import free_port, tiny_pair_files

TOOLS = Path(__file__).parent.parent / "tools"


BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def run_tool(name: str, *args: str, folder: Path = TOOLS) -> str:
    done = subprocess.run([sys.executable, str(folder / name), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def pair(tiny_dir):
    return tiny_pair_files(tiny_dir / "tools", "qwen3")


@pytest.mark.parametrize("name", sorted(p.name for p in TOOLS.glob("*.py")))
def test_every_tool_has_a_docstring_and_help(name, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", [name, "--help"])  # (in this process: every tool parses before any work)
    with pytest.raises(SystemExit) as ended:
        runpy.run_path(str(TOOLS / name), run_name="__main__")
    assert ended.value.code == 0 and capsys.readouterr().out.startswith("usage: ")
    assert (TOOLS / name).read_text().startswith('"""')


def test_launch_costs(pair):
    model, draft = pair
    out = run_tool("launch_costs.py", "--model", model, "--draft", draft, "--iters", "1", "--context", "20")
    assert "compiled verify's tokens equal eager ones: True" in out
    assert all(piece in out for piece in ("mlx-lm step", "target verify16", "verify compiled", "draft compiled"))


def test_attention_costs_says_it_needs_cuda():
    """Off CUDA (this suite's machines) it stops in one line; on CUDA it times both kernels."""
    from mlx_dflash.device import on_cuda
    if on_cuda():
        out = run_tool("attention_costs.py", "--queries", "16", "--keys", "64", "--iters", "1", "--layers", "2")
        assert out.count("| causal |") == 1 and out.count("| array |") == 1 and out.count("| True |") == 2
        return
    done = subprocess.run([sys.executable, str(TOOLS / "attention_costs.py")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr.strip() == "attention_costs: our block attention runs on MLX's CUDA backend only"


def test_cycle_timeline(pair, tmp_path):
    model, draft = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def fib(n):"}) + "\n")
    out = run_tool("cycle_timeline.py", "--model", model, "--draft", draft, "--prompts", str(prompts),
                   "--tokens", "12")
    assert out.startswith("prompt 0: mlx-lm ") and "host launch" in out and "waiting" in out


def test_policy_simulation(tmp_path):
    out = run_tool("policy_simulation.py", "--cycles", "40")
    assert out.count("tokens per plain step's cost") == 10
    # recorded texts through one warmed-up policy: a useless draft's text runs plain steps (its
    # first a forecast, as after the warm-up plain decoding won), a perfect one after it full blocks
    results = {"runs": [{"method": "dflash", "prompt": 0, "acceptance_lengths": [1] * 40},
                        {"method": "dflash", "prompt": 1, "acceptance_lengths": [16] * 40}]}
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = run_tool("policy_simulation.py", "--cycles", "60", "--block-cost", "1.19", "1.3", "1.4", "1.53",
                   "--forecast-cost", "0.15", "--runs", str(tmp_path / "results.json"))
    useless, perfect = out.splitlines()[-2:]
    assert "60 plain (3 with a forecast), 0 blocks" in useless
    assert "59 blocks" in perfect and float(perfect.split(", ")[-1].split()[0]) > 10


def test_policy_cycles(tmp_path):
    """Per size: cycles, switches, tokens, time share, tok/s, steady and switch medians."""
    cycles = [[16, 5, 0.010, False], [16, 4, 0.010, False], [65, 6, 0.020, False], [65, 7, 0.012, False],
              [16, 5, 0.011, False], [1, 1, 0.004, True]]
    results = {"config": {"tree_budgets": [64]},
               "runs": [{"method": "dflash", "prompt": 0, "policy_cycles": []},
                        {"method": "dflash_adaptive", "prompt": 0, "policy_cycles": cycles}]}
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = run_tool("policy_cycles.py", str(tmp_path / "results.json"))
    assert out.startswith("dflash_adaptive: 1 text, 6 cycles, 28 tokens in 0.07 s (417.9 tok/s)")
    assert "| tree of 64 | 2 | 1 | 13 | 6.50 | 47.8% | 406.2 | 12.00 | 20.00 |" in out
    assert "| chain of 16 | 3 | 2 | 14 | 4.67 | 46.3% | 451.6 | 10.00 | 10.50 |" in out
    assert "| plain step | 1 | 1 | 1 | 1.00 | 6.0% | 250.0 | - | 4.00 |" in out
    cycles.insert(2, [16, 3, None, False])  # (a cycle not timed: counted, but not in the time or tok/s)
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = run_tool("policy_cycles.py", str(tmp_path / "results.json"))
    assert out.startswith("dflash_adaptive: 1 text, 7 cycles, 31 tokens in 0.07 s (417.9 tok/s)")
    assert "| chain of 16 | 4 | 2 | 17 | 4.25 | 46.3% | 451.6 | 10.00 | 10.50 |" in out
    del results["runs"][1]
    (tmp_path / "results.json").write_text(json.dumps(results))
    for path in (tmp_path / "results.json", tmp_path / "missing.json"):
        done = subprocess.run([sys.executable, str(TOOLS / "policy_cycles.py"), str(path)], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_stalls(tmp_path):
    """Per method: gaps, their median, the gaps over 2x their own text's median, the time those
    took beyond it as a share of the decode time, those at a text's first response, how far the
    first gap runs past its text's median (the median over texts), and those at a cycle whose
    reads (the next block queued) first reach a 256-position key buffer: text 0's third cycle
    (242 + 2 x 4 committed + 2 blocks of 4 > 256), not text 1's first (10 + 8)."""
    results = {"block_size": 4, "prompt_tokens": [242, 10, 10], "runs": [
        {"method": "baseline", "prompt": 0, "decode_s": 0.05, "gaps": [0.004] * 9 + [0.010]},
        {"method": "dflash", "prompt": 0, "decode_s": 0.05, "gaps": [0.006, 0.006, 0.030, 0.006],
         "acceptance_lengths": [4, 4, 4, 4]},
        {"method": "dflash", "prompt": 1, "decode_s": 0.05, "gaps": [0.020, 0.008, 0.008], "acceptance_lengths": [4] * 3},
        {"method": "dflash", "prompt": 2, "decode_s": 0.05, "gaps": [0.014, 0.010, 0.010], "acceptance_lengths": [4] * 3},
    ]}
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = run_tool("stalls.py", str(tmp_path / "results.json"))
    assert "| baseline | 1 | 10 | 4.00 | 1 | 6.0 | 12.0% | 0 | 0.0 | - | 0:10 |" in out
    assert "| dflash | 3 | 10 | 9.00 | 2 | 36.0 | 24.0% | 1 | 4.0 | 1 | 0:3 1:1 |" in out
    del results["prompt_tokens"]  # (an older bench's file: no prompt lengths, no key-buffer count)
    (tmp_path / "older.json").write_text(json.dumps(results))
    assert "| 24.0% | 1 | 4.0 | - | 0:3 1:1 |" in run_tool("stalls.py", str(tmp_path / "older.json"))
    for path, flags in ((tmp_path / "missing.json", []), (tmp_path / "results.json", ["--factor", "1"])):
        done = subprocess.run([sys.executable, str(TOOLS / "stalls.py"), str(path), *flags], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_cold_start(tmp_path):
    env_folder = tmp_path / "kernels"
    done = subprocess.run([sys.executable, str(TOOLS / "cold_start.py"), "--shape", "tiny", "--length", "8",
                           "--prompt-len", "8", "--generations", "2"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MLX_PTX_CACHE_DIR": str(env_folder)})
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["generation"] for line in lines] == [1, 2]
    assert all(line["greedy_as_expected"] and line["decode_tok_s"] > 0 for line in lines)


def test_shard_costs():
    done = run_launch([sys.executable, str(TOOLS / "shard_costs.py"), "--hidden", "64", "--layers", "2", "--iters", "2"],
                      timeout=120)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(line["processes"], line["rows"]) for line in lines] == [(2, 1), (2, 16)], done.stdout + done.stderr


def test_prefix_cache_benchmark(pair):
    model, draft = pair
    out = json.loads(run_tool("prefix_cache.py", "--model", model, "--draft", draft, "--history", "300", "--reply", "20",
                              "--message", "10", "--tokens", "4", "--repeats", "1", "--json", folder=BENCHMARKS))
    assert out["same_tokens"] is True and out["turn_prompt"] == 330
    assert out["reused_tokens"] == 300 + 20 - 1  # (the history and the reply kept; its latest token never ran)
    assert 0 < out["cached_ttft_s"] and 0 < out["cold_ttft_s"]


def test_serve_benchmark(pair, tmp_path):
    model, draft = pair
    out = run_tool("serve.py", "--model", model, "--draft", draft, "--clients", "1", "2", "--requests", "1",
                   "--max-tokens", "4", "--port", str(free_port()), "--json", str(tmp_path / "serve.json"), folder=BENCHMARKS)
    rows = [line for line in out.splitlines() if line.startswith("| mlx")]
    assert len(rows) == 6  # (three servers, two client counts)
    figures = json.loads((tmp_path / "serve.json").read_text())
    assert all(r["tokens"] >= 1 for runs in figures.values() for run in runs for r in run["requests"])
    # (4 tokens: the tiny models' replies all run to the cap, and are counted there)
    assert all(run["at_cap"] == len(run["requests"]) for runs in figures.values() for run in runs)
    cells = [row.strip("| ").split(" | ") for row in rows]
    assert all(c[5].endswith("(100%)") for c in cells)
    # (the model thread's busy share: our servers report it in /health, mlx-lm's does not)
    assert all(c[6].endswith("%") and 0 < float(c[6][:-1]) <= 100 for c in cells if c[0].startswith("mlx-dflash"))
    assert all(c[6] == "-" for c in cells if c[0].startswith("mlx_lm"))
    # (without --switch-interval our servers run with Python's own: their /health says which)
    assert {run["switch_interval_s"] for label, runs in figures.items() if label.startswith("mlx-dflash")
            for run in runs} == {sys.getswitchinterval()}


def test_serve_benchmark_takes_turns_over_rounds(pair, tmp_path):
    """``--rounds 2 --servers ...``: the chosen servers started twice, taking turns, with a
    median per server and client count; ``--switch-interval S``: our servers run with that
    interpreter switch interval (their ``/health`` says so)."""
    model, draft = pair
    out = run_tool("serve.py", "--model", model, "--draft", draft, "--clients", "1", "--requests", "1",
                   "--max-tokens", "4", "--port", str(free_port()), "--servers", "batched", "one-at-a-time",
                   "--rounds", "2", "--switch-interval", "0.0005", "--json", str(tmp_path / "serve.json"),
                   folder=BENCHMARKS)
    figures = json.loads((tmp_path / "serve.json").read_text())
    assert {run["switch_interval_s"] for runs in figures.values() for run in runs} == {0.0005}
    rows = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| mlx")]
    assert rows == ["| mlx-dflash, batched", "| mlx-dflash, one at a time"] * 2 + [
        "| mlx-dflash, batched", "| mlx-dflash, one at a time"]
    medians = [line.split(" | ") for line in out.splitlines() if line.startswith("| mlx") and " / " in line
               and line.count("|") == 5]
    assert [len(m[2].split(" / ")) for m in medians] == [2, 2]


def test_batch_costs(pair):
    model, draft = pair
    out = run_tool("batch_costs.py", "--model", model, "--draft", draft, "--rows", "1", "2", "--max-tokens", "6",
                   "--repeats", "1")
    rows = [line.split(" | ")[:2] for line in out.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert rows == [["| 1", "read each cycle"], ["| 1", "queued ahead"], ["| 2", "read each cycle"], ["| 2", "queued ahead"]]
    assert out.count("both ways gave the same tokens: True") == 2
    assert [line.split(": a join takes")[0] for line in out.splitlines() if "a join takes" in line] == ["(rows=1", "(rows=2"]


@pytest.mark.parametrize("blocks", [[], ["--fixed", "--block-size", "4"], ["--pad-rows", "on"],
                                    ["--no-alone", "--join-behind", "on"]],
                         ids=["adaptive", "fixed-4", "padded", "batch-only"])
def test_batch_pattern(pair, blocks):
    model, draft = pair
    out = run_tool("batch_pattern.py", "--model", model, "--draft", draft, "--clients", "2", "--requests", "2",
                   "--max-tokens", "6", *blocks)
    assert out.splitlines()[0].startswith("4 requests from 2 clients")
    if "--no-alone" in blocks:
        assert "one at a time" not in out and "same replies" not in out, out
    else:
        assert "batch / one at a time" in out and "same replies: 4/4" in out, out
    steady, after = out.split("cycles with no join or leave before them: ")[1].split("\n")[0].split("; right after one: ")
    cycles = int(out.split(" cycles, ")[0].split("\n")[-1])
    assert int(steady.split(",")[0]) + int(after.split(",")[0]) == cycles and int(after.split(",")[0]) >= 1
    sizes, traced = out.split("block sizes ")[1].split("\n")[0].split("; compiled verifies traced: ")
    assert traced.isdigit(), traced
    by_rows = ast.literal_eval(out.split("cycles by rows: ")[1].split("\n")[0])
    assert sum(by_rows.values()) == cycles and set(by_rows) <= {1, 2}, by_rows
    if "--fixed" in blocks:
        assert int(traced) == 0, out  # (the untimed run before it traced every shape the timed run meets)
        assert set(ast.literal_eval(sizes)) <= {1, 2, 3, 4}, sizes  # (a row's last block may be shorter)


def test_tree_costs(pair):
    model, draft = pair
    out = run_tool("tree_costs.py", "--model", model, "--draft", draft, "--budgets", "20", "--num-prompts", "2",
                   "--max-tokens", "12")
    assert [line.split(" | ")[0] for line in out.splitlines()[2:5]] == ["| chain", "| tree 20, device", "| tree 20, host"]
    assert "(tree 20: both ways gave the same tokens: True)" in out


def test_draft_costs(pair):
    """A v1 draft and its identity DFlash2 copy verify the same blocks: the same texts, the same
    tokens per verify (what differs is the cost of a cycle)."""
    model, draft = pair
    out = run_tool("draft_costs.py", "--model", model, "--drafts", draft, draft, "--identity-v2", "--num-prompts", "2",
                   "--max-tokens", "12")
    rows = [line.split(" | ") for line in out.splitlines()[2:6]]
    assert [row[0] for row in rows] == [f"| {draft}", f"| {draft} as identity DFlash2"] * 2
    assert len({row[3] for row in rows}) == 1, out  # tokens per verify
    v1_ops, v2_ops = (int(row[5].rstrip(" |")) for row in rows[:2])
    assert 0 < v1_ops < v2_ops, out  # (the convolutions and the selector: more operations a draft)
    assert out.splitlines()[-1].endswith("every draft the same texts: True)")


def proposal(model, draft, features: mx.array) -> list[int]:
    """A draft's greedy block after the context ``features``."""
    from mlx_dflash.proposer import DFlashProposer
    from mlx_dflash.target import Target

    proposer = DFlashProposer(draft)
    proposer.start(Target(model, draft.config.target_layer_ids))
    proposer.add_context(features)
    return proposer.propose(mx.array([5], dtype=mx.uint32), draft.block_size - 1).tolist()


def test_draft_costs_with_the_selector_off(pair, tmp_path):
    """A DFlash2 draft whose selector re-ranks, and the copy ``--selector-off`` adds: the copy
    proposes what the v1 draft with the same weights proposes, and the original keeps its selector."""
    from mlx_dflash import load_draft, save_draft
    from mlx_dflash.draft import to_dflash2
    from mlx_dflash.target import load_target

    model_dir, draft_dir = pair
    v1 = load_draft(draft_dir)
    v2 = to_dflash2(v1)
    selector = v2.candidate_selector
    for codebook, seed in ((selector.successor_codebook, 0), (selector.predecessor_codebook, 2)):
        codebook.weight = mx.random.normal(codebook.weight.shape, key=mx.random.key(seed)) * 8
    model = load_target(model_dir)[0]
    features = mx.random.normal((1, 12, len(v1.config.target_layer_ids) * v1.config.hidden_size), key=mx.random.key(1))

    off = runpy.run_path(str(TOOLS / "draft_costs.py"))["selector_off"](v2, mx.float32)
    assert proposal(model, off, features) == proposal(model, v1, features) != proposal(model, v2, features)
    assert mx.abs(v2.candidate_selector.successor_codebook.weight).max().item() > 0  # (the original untouched)
    save_draft(v2, tmp_path / "v2")
    out = run_tool("draft_costs.py", "--model", model_dir, "--drafts", str(tmp_path / "v2"), "--selector-off",
                   "--convs-off", "--num-prompts", "1", "--max-tokens", "8")
    name = str(tmp_path / "v2")
    assert [line.split(" | ")[0] for line in out.splitlines()[2:5]] == [
        f"| {name}", f"| {name} with its selector off", f"| {name} with its convolutions off"]


def test_draft_costs_with_the_convolutions_off(pair):
    """The copy ``--convs-off`` adds of a DFlash2 draft whose convolutions are not the identity:
    with a zero successor codebook it proposes what the v1 draft with the same weights proposes."""
    from mlx_dflash import load_draft
    from mlx_dflash.draft import to_dflash2
    from mlx_dflash.target import load_target

    model_dir, draft_dir = pair
    v1 = load_draft(draft_dir)
    v2 = to_dflash2(v1)
    for seed, layer in enumerate(v2.layers):
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = mx.random.normal(conv.base_kernel.shape, key=mx.random.key(seed)) * 4
            conv.kernel_projection.weight = mx.random.normal(conv.kernel_projection.weight.shape,
                                                             key=mx.random.key(seed + 10))
    model = load_target(model_dir)[0]
    features = mx.random.normal((1, 12, len(v1.config.target_layer_ids) * v1.config.hidden_size), key=mx.random.key(1))

    off = runpy.run_path(str(TOOLS / "draft_costs.py"))["convs_off"](v2, mx.float32)
    assert proposal(model, off, features) == proposal(model, v1, features) != proposal(model, v2, features)
    assert mx.abs(v2.layers[0].attention_conv.kernel_projection.weight).max().item() > 0  # (the original untouched)


def test_window_acceptance(pair):
    model, draft = pair
    out = run_tool("window_acceptance.py", "--model", model, "--draft", draft, "--context", "0", "1500",
                   "--windows", "8", "0", "--num-prompts", "2", "--max-tokens", "12")
    lines = out.splitlines()
    assert lines[0] == "| window | context of the question | context 1500 |"
    assert lines[2].startswith("| 8 | ") and lines[3].startswith("| all | ")
    assert lines[-1].endswith("every window the same texts: True")  # (float32: the target's own tokens)
