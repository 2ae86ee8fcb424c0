"""Where a cycle's wall time goes: the host building and queueing graphs, or waiting for the device.

    python tools/cycle_timeline.py [--model M] [--draft D] [--prompt-index 0 1] [--tokens 512] [--block-size 16]
    python tools/cycle_timeline.py --scale qwen3.5-9b --replay-mean 6.5 [--tokens 1024]

Runs the engine's decode cycles on each prompt (after a warm-up run) and reports, per cycle size,
the wall time between the engine's yields and the host time it spent building and queueing the
cycle's graphs (``Cycle.launch_seconds``); the rest is the host waiting for the device (or doing
bookkeeping). Beside it, mlx-lm's own greedy steps on the same prompt. If the waits are near
zero, the host is the bottleneck (a small model on a big GPU: launch-bound) and queueing cycles
ahead cannot help; if they are large, the device is.

``--scale SHAPE --replay-mean M``: as the benchmark's scale mode, a random-weight target of that
shape, one random 128-token prompt, and a random draft that runs every cycle, its proposals
replaced by mlx-lm's greedy tokens corrupted to a mean acceptance of M (``replay.py``).
"""

import argparse
import time
from collections import defaultdict

import mlx.core as mx

from mlx_dflash import use_fast_blas


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target (default: the embedded default model)")
    parser.add_argument("--draft", default=None, help="default: the draft shipped for --model")
    parser.add_argument("--prompts", default=None, help="JSONL prompts (default: the bench's HumanEval set)")
    parser.add_argument("--prompt-index", type=int, nargs="+", default=[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--scale", default=None, help="a scale-mode shape (random weights) instead of --model")
    parser.add_argument("--replay-mean", type=float, default=6.5, help="with --scale: the replay's mean acceptance")
    return parser.parse_args()


def load(args):
    """(model, tokenizer, draft, prompts, proposer for a prompt)."""
    from mlx_dflash import load as load_pair
    from mlx_dflash.bench import humaneval_prompts, run_mlx_lm
    from mlx_dflash.data import encode_chat, read_prompts
    from mlx_dflash.proposer import DFlashProposer
    from mlx_dflash.replay import ReplayProposer, geometric_schedule
    from mlx_dflash.scale import null_tokenizer, random_draft, random_target

    if not args.scale:
        model, tokenizer, draft = load_pair(args.model, args.draft)
        texts = read_prompts(args.prompts) if args.prompts else humaneval_prompts()
        return model, tokenizer, [encode_chat(tokenizer, t) for t in texts], lambda prompt: DFlashProposer(draft)
    model, config = random_target(args.scale)
    tokenizer = null_tokenizer(config["vocab_size"])
    draft = random_draft(config, block_size=args.block_size or 16)
    prompts = [mx.random.randint(0, config["vocab_size"], (128,), key=mx.random.key(0)).tolist()]

    def replay(prompt):
        reference = run_mlx_lm(model, tokenizer, prompt, args.tokens)[0]
        schedule = geometric_schedule(args.replay_mean, draft.block_size)
        return ReplayProposer(prompt + reference, draft.block_size, schedule, config["vocab_size"],
                              cost_of=DFlashProposer(draft))
    return model, tokenizer, prompts, replay


def dflash_timeline(model, proposer, prompt: list[int], tokens: int, block_size) -> dict:
    """Totals over a generation's cycles: their count per size, wall and launch seconds, and
    the mean acceptance length. (A cycle's launch may fall in the window of the cycle before
    it, where cycles are launched ahead: hence totals, not per-cycle pairs.)"""
    from mlx_dflash.engine import decode_cycles
    from mlx_dflash.target import Target

    target = Target(model, proposer.layer_ids)
    sizes: dict[int, int] = defaultdict(int)
    launch, accepted = 0.0, []
    cycles = decode_cycles(target, proposer, mx.array(prompt), tokens, block_size or proposer.block_size)
    next(cycles)  # the prefill
    tic = time.perf_counter()
    for cycle in cycles:
        sizes[cycle.block_size] += 1
        launch += cycle.launch_seconds
        accepted.append(cycle.acceptance_length)
    wall = time.perf_counter() - tic
    return {"sizes": dict(sizes), "wall": wall, "launch": launch, "cycles": len(accepted),
            "mean": sum(accepted) / max(len(accepted), 1)}


def mlx_lm_step_ms(model, prompt: list[int], tokens: int) -> float:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=tokens)
    next(steps)  # the prefill
    tic, count = time.perf_counter(), 0
    for count, _ in enumerate(steps, 1):
        pass
    return 1000 * (time.perf_counter() - tic) / max(count, 1)


def main() -> None:
    args = parse_args()
    use_fast_blas()
    model, tokenizer, prompts, proposer_for = load(args)
    for index in args.prompt_index:
        prompt = prompts[index]
        proposer = proposer_for(prompt)
        dflash_timeline(model, proposer, prompt, args.tokens, args.block_size)  # warm-up
        mlx_lm_step_ms(model, prompt, args.tokens)
        run = dflash_timeline(model, proposer, prompt, args.tokens, args.block_size)
        per_cycle = lambda seconds: 1000 * seconds / max(run["cycles"], 1)  # noqa: E731
        sizes = ", ".join(f"{count} of {size}" for size, count in sorted(run["sizes"].items()))
        print(f"prompt {index}: mlx-lm {mlx_lm_step_ms(model, prompt, args.tokens):.2f} ms a step; DFlash "
              f"{run['cycles']} cycles ({sizes} tokens), mean acceptance {run['mean']:.2f}, "
              f"{per_cycle(run['wall']):.2f} ms a cycle: host launch {per_cycle(run['launch']):.2f} ms, "
              f"waiting {per_cycle(run['wall'] - run['launch']):.2f} ms", flush=True)

if __name__ == "__main__":
    main()
