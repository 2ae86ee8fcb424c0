"""Does the server say what `generate` says? Greedy replies through `mlx-dflash serve` (the official
``openai`` client, several clients at once, so requests share the batch) against the same prompts
decoded in this process by ``mlx_dflash.generate``.

    python benchmarks/serve_vs_generate.py [--model M] [--draft D] [--num-prompts 16] [--clients 4] [--max-tokens 256]

Prompts: HumanEval's, as `mlx-dflash bench` takes them. Prints how many replies are equal, and the
first differing character of each one that is not. On a GPU in bfloat16 a near-tie may be settled
differently by a batch's shapes (docs/exactness.md); in float32 every reply should be equal.
"""

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI
from serve import one_request, start

from mlx_dflash import generate, load, use_fast_blas
from mlx_dflash.bench import humaneval_prompts
from mlx_dflash.models import DEFAULT_MODEL, shipped_draft


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a registered name or an mlx-lm model folder "
                                                      "(default: the embedded default model)")
    parser.add_argument("--draft", default=None, help="default: the draft shipped for the model")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--clients", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--port", type=int, default=8392)
    return parser.parse_args()


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    args = parse_args()
    use_fast_blas()
    model_name = args.model or DEFAULT_MODEL
    draft = args.draft or shipped_draft(model_name)
    prompts = humaneval_prompts()[: args.num_prompts]

    command = [sys.executable, "-m", "mlx_dflash.cli", "serve", "--model", model_name, "--draft", draft,
               "--port", str(args.port), "--decode-concurrency", str(args.clients)]
    process = start(command, args.port)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", timeout=3600, max_retries=0)
        served = client.models.list().data[0].id
        with ThreadPoolExecutor(args.clients) as pool:
            replies = list(pool.map(lambda p: one_request(client, served, p, args.max_tokens)["text"], prompts))
    finally:
        process.terminate()
        process.wait(timeout=60)

    model, tokenizer, draft_model = load(model_name, draft)
    equal = 0
    for i, (prompt, reply) in enumerate(zip(prompts, replies)):
        alone = generate(model, tokenizer, prompt, draft_model, max_tokens=args.max_tokens, chat=True).text
        if alone == reply:
            equal += 1
        else:
            at = first_difference(alone, reply)
            print(f"prompt {i}: differs at character {at}: generate {alone[at:at + 40]!r}, "
                  f"serve {reply[at:at + 40]!r}")
    print(f"{equal}/{len(prompts)} replies equal ({args.clients} clients, {args.max_tokens} tokens at most)")


if __name__ == "__main__":
    main()
