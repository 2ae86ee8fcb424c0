"""Time to first token of a chat turn after a long history: cold, and with the prefix cache.

    python benchmarks/prefix_cache.py [--model M] [--draft D] [--history 4000] [--repeats 3]
    python benchmarks/prefix_cache.py --scale qwen3-8b     # a random-weight target of that shape

A turn's prompt is the history (the previous turn's whole prompt), the previous reply
(``--reply`` tokens) and a new message (``--message`` tokens), as a chat client resends it.
Cold: a fresh prefix cache, so the whole prompt is prefilled. Cached: the previous turn's
prompt ran first with the cache (as the server does), so only the reply and the message are.
Prints the median time to first token of each over ``--repeats`` turns (each with a history of
its own ids), their ratio, and whether both gave the same tokens; JSON with ``--json``.
"""

import argparse
import json
import statistics

import mlx.core as mx

from mlx_dflash import PrefixCache, generate, use_fast_blas


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="target (default: the embedded default model)")
    parser.add_argument("--draft", default=None, help="default: the draft shipped for --model")
    parser.add_argument("--scale", default=None, help="a scale-mode shape (random weights) instead of --model")
    parser.add_argument("--history", type=int, default=4000, help="tokens of the previous turn's prompt")
    parser.add_argument("--reply", type=int, default=200, help="tokens of the previous reply")
    parser.add_argument("--message", type=int, default=50, help="tokens of the new message")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated each turn")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def load(args):
    if args.scale:
        from mlx_dflash.scale import null_tokenizer, random_draft, random_target

        model, config = random_target(args.scale)
        return model, null_tokenizer(config["vocab_size"]), random_draft(config)
    from mlx_dflash import load as load_pair

    return load_pair(args.model, args.draft)


def main() -> None:
    args = parse_args()
    use_fast_blas()
    model, tokenizer, draft = load(args)
    vocab = min(tokenizer.vocab_size, 32000)
    warm = mx.random.randint(0, vocab, (64,)).tolist()
    generate(model, tokenizer, warm, draft, max_tokens=args.tokens, warmup=True)  # (kernels built, not timed)
    cold_s, cached_s, same = [], [], True
    for repeat in range(args.repeats):
        mx.random.seed(repeat)
        history = mx.random.randint(0, vocab, (args.history,)).tolist()
        turn = history + mx.random.randint(0, vocab, (args.reply + args.message,)).tolist()
        cold = generate(model, tokenizer, turn, draft, max_tokens=args.tokens, prefix_cache=PrefixCache(1 << 40))
        cache = PrefixCache(1 << 40)
        generate(model, tokenizer, history, draft, max_tokens=args.tokens, prefix_cache=cache)  # the previous turn
        cached = generate(model, tokenizer, turn, draft, max_tokens=args.tokens, prefix_cache=cache)
        cold_s.append(cold.prefill_seconds)
        cached_s.append(cached.prefill_seconds)
        same &= cold.tokens == cached.tokens and cached.reused_prompt_tokens == args.history - 1
    result = {"model": args.scale or args.model or "default", "device": str(mx.default_device()),
              "history": args.history, "turn_prompt": args.history + args.reply + args.message,
              "cold_ttft_s": statistics.median(cold_s), "cached_ttft_s": statistics.median(cached_s),
              "same_tokens": same}
    result["cached_over_cold"] = result["cached_ttft_s"] / result["cold_ttft_s"]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['model']} ({result['device']}): turn of {result['turn_prompt']} tokens after a "
              f"{args.history}-token history: time to first token cold {result['cold_ttft_s']:.3f} s, "
              f"cached {result['cached_ttft_s']:.3f} s ({result['cached_over_cold']:.1%} of cold); "
              f"same tokens: {same}")


if __name__ == "__main__":
    main()
