"""Time to first token of a chat turn after a long history: cold, and with the prefix cache.

    python benchmarks/prefix_cache.py [--model M] [--draft D] [--history 4000] [--repeats 3]
    python benchmarks/prefix_cache.py --scale qwen3-8b     # a random-weight target of that shape

A turn's prompt is the history (the previous turn's whole prompt), the previous turn's reply
(the ``--reply`` tokens it generated) and a new message (``--message`` tokens), as a chat
client resends it. Cold: a fresh prefix cache, so the whole prompt is prefilled. Cached: the
previous turn ran with the cache (as the server does), which kept its prompt and reply, so
only the message is prefilled. Prints the median time to first token of each over
``--repeats`` turns (each with a history of its own ids), their ratio, the prompt tokens
restored, and whether both gave the same tokens; JSON with ``--json``.
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
    parser.add_argument("--reply", type=int, default=200, help="tokens the previous turn generates")
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
    tokenizer.eos_token_ids = set()  # (every reply its full length)
    cold_s, cached_s, reused, same = [], [], [], True
    for repeat in range(args.repeats):
        mx.random.seed(repeat)
        history = mx.random.randint(0, vocab, (args.history,)).tolist()
        cache = PrefixCache(1 << 40)
        reply = generate(model, tokenizer, history, draft, max_tokens=args.reply, prefix_cache=cache).tokens
        turn = history + reply + mx.random.randint(0, vocab, (args.message,)).tolist()
        cached = generate(model, tokenizer, turn, draft, max_tokens=args.tokens, prefix_cache=cache)
        cold = generate(model, tokenizer, turn, draft, max_tokens=args.tokens, prefix_cache=PrefixCache(1 << 40))
        cold_s.append(cold.prefill_seconds)
        cached_s.append(cached.prefill_seconds)
        reused.append(cached.reused_prompt_tokens)
        same &= cold.tokens == cached.tokens
    result = {"model": args.scale or args.model or "default", "device": str(mx.default_device()),
              "history": args.history, "turn_prompt": args.history + args.reply + args.message,
              "reused_tokens": statistics.median(reused),
              "cold_ttft_s": statistics.median(cold_s), "cached_ttft_s": statistics.median(cached_s),
              "same_tokens": same}
    result["cached_over_cold"] = result["cached_ttft_s"] / result["cold_ttft_s"]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['model']} ({result['device']}): turn of {result['turn_prompt']} tokens after a "
              f"{args.history}-token history: time to first token cold {result['cold_ttft_s']:.3f} s, "
              f"cached {result['cached_ttft_s']:.3f} s ({result['cached_over_cold']:.1%} of cold, "
              f"{result['reused_tokens']:.0f} tokens restored); "
              f"same tokens: {same}")


if __name__ == "__main__":
    main()
