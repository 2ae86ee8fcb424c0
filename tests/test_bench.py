"""The benchmark harness on tiny models: it runs, token_match is right, the JSON is complete."""

import functools
import json

import mlx.core as mx
import pytest

from tiny_models import MASK_ID, VOCAB_SIZE, load_tiny, make_tiny_target

from mlx_dflash import create_random_draft
from mlx_dflash.bench import BenchConfig, markdown_table, run_bench, token_match
from mlx_dflash.replay import ReplayProposer, geometric_schedule

SUMMARY_FIELDS = {"method", "length", "prompts", "decode_tokens_per_sec", "ttft_s_median", "peak_memory_gb",
                  "generated_tokens", "token_match", "speedup_vs_baseline", "decode_tokens_per_sec_by_prompt",
                  "speedup_by_prompt", "median_speedup", "prompts_at_cap", "speedup_without_capped"}
DFLASH_FIELDS = {"cycles", "mean_acceptance_length", "acceptance_histogram", "acceptance_by_position"}


def test_token_match():
    assert token_match([1, 2, 3], [1, 2, 3]) is True
    assert token_match([1, 9, 3], [1, 2, 3]) == 1
    assert token_match([1, 2], [1, 2, 3]) == 2


def test_bench_runs_and_writes_everything(tiny_dir, tmp_path):
    path = make_tiny_target(tiny_dir / "bench-qwen3", "qwen3")
    model, tokenizer = load_tiny(path)
    draft = create_random_draft(json.loads((path / "config.json").read_text()), num_layers=1, mask_token_id=MASK_ID)
    prompts = [tokenizer.encode("one"), tokenizer.encode("two two")]
    replay = functools.partial(ReplayProposer, block_size=16, schedule=geometric_schedule(6.5, 16),
                               vocab_size=VOCAB_SIZE)
    ar_draft = load_tiny(make_tiny_target(tiny_dir / "bench-ar", "qwen3", num_hidden_layers=1, seed=1))[0]
    cfg = BenchConfig(lengths=[12, 20], repeats=2, no_eos=True, num_draft_tokens=(2, 4))
    summary = run_bench(model, tokenizer, prompts, {"dflash": draft, "dflash_replay": replay}, cfg,
                        ar_draft=ar_draft, out_dir=tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(summary))
    assert saved["prompt_tokens"] == [len(p) for p in prompts] and saved["block_size"] == 16  # (tools/stalls.py)
    assert len(saved["runs"]) == 2 * 2 * 2 * 5  # prompts x lengths x repeats x methods
    for method in ("baseline", "mlx_lm_speculative_k2", "mlx_lm_speculative_k4", "dflash", "dflash_replay"):
        for length in (12, 20):
            entry = summary[f"{method}@{length}"]
            assert SUMMARY_FIELDS <= set(entry)
            assert entry["generated_tokens"] == 2 * length  # --no-eos: every run is full length
            # greedy, float32: every method reproduces plain decoding
            assert all(m is True for m in entry["token_match"].values()), entry["token_match"]
            if method.startswith("dflash"):
                assert DFLASH_FIELDS <= set(entry)
                assert len(entry["acceptance_histogram"]) == 16
                assert len(entry["acceptance_by_position"]) == 15
    assert summary["dflash_replay@20"]["mean_acceptance_length"] > summary["dflash@20"]["mean_acceptance_length"]
    for run in saved["runs"]:  # the gaps between responses: one fewer than the responses (a token, a cycle)
        responses = len(run["acceptance_lengths"]) + 1 if run["method"].startswith("dflash") else run["length"]
        assert len(run["gaps"]) == responses - 1 and all(gap > 0 for gap in run["gaps"]), run["method"]
    for png in ("tokens_per_sec.png", "acceptance.png"):
        assert (tmp_path / png).stat().st_size > 0
    assert "| dflash | 12 |" in markdown_table(summary)
    # each prompt's ratio: its own rate over the baseline's on the same prompt
    entry, base = summary["dflash@20"], summary["baseline@20"]
    for p, ratio in entry["speedup_by_prompt"].items():
        assert ratio == entry["decode_tokens_per_sec_by_prompt"][p] / base["decode_tokens_per_sec_by_prompt"][p]
    ratios = sorted(entry["speedup_by_prompt"].values())
    assert len(ratios) == 2 and f"| {ratios[0]:.2f}-{ratios[1]:.2f}x |" in markdown_table(summary)
    # the draft count of mlx-lm's speculative decoding with the best median, named per length
    for length in (12, 20):
        k = max((2, 4), key=lambda k: summary[f"mlx_lm_speculative_k{k}@{length}"]["median_speedup"])
        assert f"speculative decoding at {length} tokens: best --num-draft-tokens {k} " in markdown_table(summary)


def test_baselines_first_times_mlx_lm_before_any_dflash(tiny_dir, monkeypatch):
    from mlx_dflash import bench

    path = make_tiny_target(tiny_dir / "bench-order-qwen3", "qwen3")
    model, tokenizer = load_tiny(path)
    draft = create_random_draft(json.loads((path / "config.json").read_text()), num_layers=1, mask_token_id=MASK_ID)
    prompts = [tokenizer.encode("one"), tokenizer.encode("two two")]
    order = []
    for name in ("run_mlx_lm", "run_dflash", "warm_up"):
        real = getattr(bench, name)
        monkeypatch.setattr(bench, name, lambda *a, _real=real, _name=name, **k: order.append(_name) or _real(*a, **k))
    cfg = BenchConfig(lengths=[12], no_eos=True, baselines_first=True)
    summary = run_bench(model, tokenizer, prompts, {"dflash": draft}, cfg)
    # warm-up of mlx-lm, both baselines, then DFlash's warm-up and runs; DFlash still matches
    assert order[:3] == ["run_mlx_lm"] * 3 and "run_mlx_lm" not in order[3:] and order[3] == "warm_up"
    assert all(m is True for m in summary["dflash@12"]["token_match"].values())


def test_adaptive_runs_record_what_their_policy_saw(tiny_dir, tmp_path):
    """Each adaptive run keeps its policy's view of every cycle (size, acceptance, measured
    seconds, forecast), the evidence for why it chose its sizes; fixed runs keep none."""
    path = make_tiny_target(tiny_dir / "bench-policy-qwen3", "qwen3")
    model, tokenizer = load_tiny(path)
    draft = create_random_draft(json.loads((path / "config.json").read_text()), num_layers=1, mask_token_id=MASK_ID)
    prompts = [tokenizer.encode("one"), tokenizer.encode("two two")]
    cfg = BenchConfig(lengths=[24], no_eos=True, warmup=False)
    run_bench(model, tokenizer, prompts, {"dflash": draft, "dflash_adaptive": draft}, cfg, out_dir=tmp_path)
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    adaptive = [r for r in runs if r["method"] == "dflash_adaptive"]
    assert len(adaptive) == 2 and all(not r["policy_cycles"] for r in runs if r["method"] != "dflash_adaptive")
    for run in adaptive:
        cycles = run["policy_cycles"]
        assert len(cycles) == len(run["acceptance_lengths"])  # one per cycle (the prefill's token is none)
        assert all(block in (1, 2, 4, 8, 16) and 1 <= a <= block for block, a, _, _ in cycles)
        # (a cycle whose window the consumer mostly held is not timed: None, CycleClock)
        timed = [seconds for _, _, seconds, _ in cycles if seconds is not None]
        assert timed and all(seconds > 0 for seconds in timed)
        assert [a for _, a, _, _ in cycles][:-1] == run["acceptance_lengths"][:-1]


@pytest.mark.parametrize("shape", ["tiny", "tiny-hybrid"])
def test_scale_targets_have_a_steady_greedy_continuation(shape):
    """A replay needs a trajectory that bfloat16 rounding cannot flip: near-flat random logits
    (top two often tied in bfloat16) make a replay of 6.5 accept 1.00."""
    from mlx_dflash.scale import random_target

    model, config = random_target(shape)
    tokens = mx.random.randint(0, config["vocab_size"], (1, 32), key=mx.random.key(0))
    logits = model(tokens).astype(mx.float32)[0]
    second, first = mx.split(mx.sort(logits, axis=-1)[:, -2:], 2, axis=-1)
    assert mx.array_equal(mx.argmax(logits, axis=-1), tokens[0])
    assert mx.min((first - second) / mx.abs(first)).item() > 0.2


def test_scale_modes_tokenizer_streams_each_token_once():
    """Scale mode's tokenizer streams text through mlx-lm's SentencePiece detokenizer (constant
    work a token, as real tokenizers'), not the default one, which decoded the whole unending
    line again for every token: O(T^2) work that mlx-lm's baseline paid every token."""
    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer

    from mlx_dflash.scale import null_tokenizer

    detokenizer = null_tokenizer(100).detokenizer
    assert isinstance(detokenizer, SPMStreamingDetokenizer)
    detokenizer.reset()
    for token in (5, 6, 42):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == "t5 t6 t42"


def test_scale_mode_on_a_hybrid_shape(tmp_path, capsys):
    """Scale mode end to end on the tiny Gated DeltaNet shape with a quantized draft (a quantized
    target works the same way but MLX's CPU quantized matmul makes it 8x slower here)."""
    from mlx_dflash.cli import main

    out = tmp_path / "scale"
    assert main(["bench", "--scale", "tiny-hybrid", "--draft-quant", "8", "--lengths", "24", "--block-size", "4",
                 "--replay-mean", "3", "--num-prompts", "1", "--context", "16", "40", "--draft-layers", "1",
                 "--out", str(out)]) == 0
    for context in (16, 40):  # (a run per context, each in its own folder)
        summary = json.loads((out / f"context-{context}" / "results.json").read_text())["summary"]
        assert summary["dflash_replay_mean3.0@24"]["token_match"] == {"0": True}
        assert summary["baseline@24"]["peak_memory_gb"] > 0
    costs = json.loads((out / "cycle_costs.json").read_text())
    assert [c["context_len"] for c in costs] == [16, 24, 40]
    assert all(c["rollback_ms"] >= 0 and c["verify_plus_rollback_ms"] > 0 for c in costs)
    assert all(0 < c["host_ms"] < c["verify_plus_rollback_ms"] + c["draft_ms"] for c in costs)
    fast = tmp_path / "costs"
    assert main(["bench", "--scale", "tiny-hybrid", "--costs-only", "--lengths", "32", "--context", "16",
                 "--draft-layers", "1", "--draft-vocab", "512", "--out", str(fast)]) == 0
    assert not (fast / "results.json").exists()
    trees = tmp_path / "tree-costs"  # (an attention target: what a tree's verify costs there)
    assert main(["bench", "--scale", "tiny", "--costs-only", "--lengths", "32", "--context", "16",
                 "--draft-layers", "1", "--block-size", "4", "--replay-mean", "3", "--tree-budgets", "8",
                 "--out", str(trees)]) == 0
    costs = json.loads((trees / "cycle_costs.json").read_text())
    assert all(c["tree8_verify_ms"] > 0 and "tree32_verify_ms" not in c for c in costs)
    assert [c["context_len"] for c in json.loads((fast / "cycle_costs.json").read_text())] == [16, 32]
    assert main(["bench", "--draft-vocab", "512", "--lengths", "8"]) == 2  # a real draft brings its own
    assert "scale mode only" in capsys.readouterr().err


def test_the_summary_reports_the_median_and_texts_at_the_cap_apart():
    """A text that runs to the cap (a loop, easy to draft) flatters the aggregate: the median of the
    prompts' own speed-ups and the aggregate without such texts are reported beside it."""
    import statistics

    from mlx_dflash.bench import Run, summarize

    def run(method, prompt, tokens, seconds):
        return Run(method=method, prompt=prompt, length=100, tokens=list(range(tokens)), prefill_s=0.1,
                   decode_s=seconds, acceptance_lengths=[2] if method == "dflash" else [], policy_cycles=[])
    runs = [run("baseline", 0, 100, 10.0), run("dflash", 0, 100, 1.0),  # at the cap, 10x faster
            run("baseline", 1, 41, 4.0), run("dflash", 1, 41, 2.0),  # 2x
            run("baseline", 2, 21, 2.0), run("dflash", 2, 21, 1.0)]  # 2x
    entry = summarize(runs, 16)["dflash@100"]
    assert entry["prompts_at_cap"] == [0]
    assert entry["median_speedup"] == statistics.median(entry["speedup_by_prompt"].values()) == 2.0
    assert entry["speedup_vs_baseline"] == (99 + 40 + 20) / 4.0 / ((99 + 40 + 20) / 16.0)  # 4x, flattered
    assert abs(entry["speedup_without_capped"] - 2.0) < 1e-12
    table = markdown_table({"dflash@100": entry})
    assert "| 4.00x | 2.00x | 2.00-10.00x | 1/3 | 2.00x |" in table


def test_long_context_prompts(tmp_path, capsys):
    """A question after source files: within a few tokens of the context asked for, never
    past it, each prompt starting at other files; the bench runs a table per context."""
    from mlx_dflash.bench_prompts import long_context_prompts
    from mlx_dflash.cli import main
    from mlx_dflash.errors import DFlashError
    from tiny_models import tiny_pair_files

    source = tmp_path / "project"
    source.mkdir()
    for i in range(5):
        (source / f"module{i}.py").write_text(f"def f{i}(x):\n    return x * {i}  # module {i}\n" * 30)
    model_dir, draft_dir = tiny_pair_files(tmp_path / "pair", "qwen3")
    tokenizer = load_tiny(model_dir)[1]
    questions = ["Complete: def g(x):", "Complete: def h(y):"]
    for chat in (True, False):
        prompts = long_context_prompts(tokenizer, questions, 300, str(source), chat=chat)
        assert all(290 <= len(p) <= 300 for p in prompts)
        texts = [tokenizer.decode(p) for p in prompts]
        assert all(q in t for q, t in zip(questions, texts)) and "module0.py" in texts[0] and texts[0] != texts[1]
    with pytest.raises(DFlashError, match="no room"):
        long_context_prompts(tokenizer, questions, 10, str(source))
    with pytest.raises(DFlashError, match="no .py files"):
        long_context_prompts(tokenizer, questions, 300, str(tmp_path / "pair" / "draft"))

    prompts_file = tmp_path / "questions.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    out = tmp_path / "bench"
    assert main(["bench", "--model", model_dir, "--draft", draft_dir, "--prompts", str(prompts_file), "--num-prompts", "2",
                 "--context", "120", "200", "--context-source", str(source), "--lengths", "6", "--no-warmup",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "## context 120: prompts of" in printed and "## context 200: prompts of" in printed
    for context in (120, 200):
        summary = json.loads((out / f"context-{context}" / "results.json").read_text())["summary"]
        assert summary["dflash@6"]["token_match"] == {"0": True, "1": True}
    assert main(["bench", "--context", "1"]) == 2
    assert main(["bench", "--ar-draft", "x", "--num-draft-tokens", "3", "0"]) == 2
    assert main(["bench", "--model", model_dir, "--draft", draft_dir, "--context", "2040", "--lengths", "16"]) == 2
    assert "passes the model's context of 2048 tokens" in capsys.readouterr().err


def test_tree_methods_are_warmed_and_exact(tiny_dir, tmp_path, monkeypatch):
    """Methods dflash_tree<B>, below the block and past it: the warm-up runs each budget's fixed
    trees before anything is timed; every run reproduces plain decoding; the adaptive method's
    policy takes only the tree of at least a block (it refuses smaller ones)."""
    import mlx_dflash.bench as bench

    path = make_tiny_target(tiny_dir / "bench-trees", "qwen3")
    model, tokenizer = load_tiny(path)
    draft = create_random_draft(json.loads((path / "config.json").read_text()), num_layers=1, block_size=8,
                                mask_token_id=MASK_ID)
    runs, run_dflash = [], bench.run_dflash
    monkeypatch.setattr(bench, "run_dflash", lambda *a: runs.append(a[8:]) or run_dflash(*a))
    methods = {"dflash": draft, "dflash_adaptive": draft, "dflash_tree4": draft, "dflash_tree12": draft}
    summary = run_bench(model, tokenizer, [tokenizer.encode("one")], methods,
                        BenchConfig(lengths=[12], no_eos=True, tree_budgets=[4, 12]), out_dir=tmp_path)
    timed = len(methods)
    assert {(4,), (12,)} <= set(runs[:-timed])  # (warmed: a fixed tree of each budget)
    assert all(summary[f"{m}@12"]["token_match"] == {0: True} for m in methods)
