"""The server's batch without the server: C clients each send K greedy chat requests in turn,
served by the batch decoder as ``mlx-dflash serve`` does, beside the same requests one at a time.

    python tools/batch_pattern.py [--model M] [--draft D] [--clients 8] [--requests 2] [--max-tokens 256]
        [--block-size B] [--fixed] [--pad-rows on|off] [--join-behind on|off] [--no-alone]

The requests are HumanEval prompts in the chat template, each reply ending at EOS or
``--max-tokens``. In the batch a reply's row leaves at the end of the cycle that finished it
and the client's next request joins (its prompt prefilled alone), with the server's adaptive
policy (``--fixed``: full blocks of ``--block-size``) and prefix cache, its rows padded to a
power of two on GPUs (``--pad-rows``: on or off anywhere, ``EngineOptions.pad_rows``), and
a request that joins while a cycle is queued prefilled behind it on GPUs (``--join-behind``:
on or off anywhere, ``EngineOptions.join_behind``). Alone (unless ``--no-alone``, for A/Bs of
the batch's options), each request runs on the single-sequence engine with a policy of its own
that carries over and a prefix cache, as a server serving one at a time. Both ways run once untimed first
(kernels built, policies taught), then timed. Reported:
tokens/s over the wall time of each way; for the batch the seconds spent in joins, cycles and
leaves (and of the cycles, the median of those with no join or leave just before them against
the seconds of those right after one), the cycles' block sizes, rows a cycle (and cycles by
rows: fewer than the clients once clients have sent their last request) and tokens a row and
cycle, how many times the compiled verify was traced (a new shape each), and what its policy
believed at the end (cost a cycle per size and row count, expected tokens a row per size); and
how many replies are the same both ways (float32: all).
"""

import argparse
import statistics
import time
from collections import Counter
from typing import Optional

import mlx.core as mx

from mlx_dflash import generate, load, use_fast_blas
from mlx_dflash.batch import BatchDecoder, until_eos
from mlx_dflash.bench import humaneval_prompts
from mlx_dflash.generate import encode_prompt
from mlx_dflash.options import EngineOptions
from mlx_dflash.policy import BlockPolicy
from mlx_dflash.prefix_cache import DEFAULT_SIZE, PrefixCache, parse_bytes

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
parser.add_argument("--draft", default=None, help="default: the draft shipped for the model")
parser.add_argument("--clients", type=int, default=8)
parser.add_argument("--requests", type=int, default=2, help="requests each client sends, one after the other")
parser.add_argument("--max-tokens", type=int, default=256)
parser.add_argument("--block-size", type=int, default=None, help="the largest block (default: the draft's)")
parser.add_argument("--fixed", action="store_true", help="full blocks instead of the adaptive policy")
parser.add_argument("--pad-rows", choices=["on", "off"], default=None,
                    help="the batch a power of two rows wide (default: on GPUs)")
parser.add_argument("--join-behind", choices=["on", "off"], default=None,
                    help="requests that join while a cycle is queued prefilled behind it (default: on GPUs)")
parser.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                    help="the same requests one at a time beside the batch (--no-alone: the batch only)")
args = parser.parse_args()

use_fast_blas()
model, tokenizer, draft = load(args.model, args.draft)
EOS = frozenset(tokenizer.eos_token_ids)
block_size = args.block_size or draft.block_size
prompts = [encode_prompt(tokenizer, text, chat=True) for text in humaneval_prompts()[: args.clients * args.requests]]


def prefix_cache() -> PrefixCache:
    return PrefixCache(parse_bytes(DEFAULT_SIZE))


def batched(decoder: BatchDecoder) -> tuple[float, dict[int, list[int]], Counter, Counter, list[float]]:
    """(wall seconds, every request's reply, seconds per part and tokens the cycles committed, rows per cycle,
    the seconds of each cycle with no join or leave just before it)."""
    waiting = {c: list(range(c, len(prompts), args.clients)) for c in range(args.clients)}
    replies, client_of, parts, rows, steady = {}, {}, Counter(), Counter(), []
    changed = False  # rows joined or left since the latest cycle

    def join(client: int) -> None:
        nonlocal changed
        changed = True
        while waiting[client]:
            request = waiting[client].pop(0)
            tic = time.perf_counter()
            row = decoder.add(prompts[request], args.max_tokens)
            parts["joins"] += time.perf_counter() - tic
            replies[request] = list(row.tokens)
            if row.id in decoder.rows and row.first not in EOS:
                client_of[row.id] = (client, request)
                return
            decoder.remove(row.id)  # (its reply ended with the prefill's token)

    tic = time.perf_counter()
    for client in range(args.clients):
        join(client)
    while decoder.rows:
        start = time.perf_counter()
        committed = decoder.step()
        seconds = time.perf_counter() - start
        parts["cycles"] += seconds
        # (a row prefilled behind a queued cycle gets its first token from a step: not the cycle's)
        cycled = {r: t for r, t in committed.items() if replies[client_of[r][1]]}
        if cycled:
            if changed:
                parts["cycles after a change"] += seconds
            else:
                steady.append(seconds)
            changed = False
            rows[len(cycled)] += 1
            parts["tokens"] += sum(map(len, cycled.values()))  # (not seconds: a count)
        for row_id, tokens in committed.items():
            client, request = client_of[row_id]
            replies[request] += tokens
            if row_id in decoder.rows and any(t in EOS for t in tokens):
                start = time.perf_counter()
                decoder.remove(row_id)
                parts["leaves"] += time.perf_counter() - start
                changed = True
            if row_id not in decoder.rows:  # (it left: in this step, or just now)
                join(client)
    mx.synchronize()
    return time.perf_counter() - tic, {r: until_eos(t, EOS) for r, t in replies.items()}, parts, rows, steady


def alone(policy) -> tuple[float, dict[int, list[int]]]:
    """(wall seconds, every request's reply) served one at a time, with a prefix cache as the server's."""
    tic, replies, cache = time.perf_counter(), {}, prefix_cache()
    for request, prompt in enumerate(prompts):
        replies[request] = until_eos(generate(model, tokenizer, prompt, draft, max_tokens=args.max_tokens,
                                              block_size=block_size, adaptive=policy, prefix_cache=cache).tokens, EOS)
    return time.perf_counter() - tic, replies


def switch(value: Optional[str]) -> Optional[bool]:
    """An ``on``/``off`` argument as an option's value (None: the backend's default)."""
    return None if value is None else value == "on"


def policy():
    return False if args.fixed else BlockPolicy(block_size)


decoder = BatchDecoder(model, draft, block_size, prefix_cache=prefix_cache(), policy=policy() or None,
                       options=EngineOptions(pad_rows=switch(args.pad_rows), join_behind=switch(args.join_behind)))
solo_policy = policy()
batched(decoder)
if args.alone:
    alone(solo_policy)
decoder.block_sizes.clear()
decoder.prefix_cache = prefix_cache()  # (the timed run meets the prompts afresh)
traced = decoder.target.recorder.traces
wall, replies, parts, rows, steady = batched(decoder)
traced = decoder.target.recorder.traces - traced
tokens = sum(len(t) for t in replies.values())
cycles = max(sum(rows.values()), 1)
print(f"{len(prompts)} requests from {args.clients} clients, {tokens} tokens, "
      f"{sum(len(t) == args.max_tokens for t in replies.values())} at --max-tokens")
print(f"batch: {tokens / wall:.1f} tok/s; joins {parts['joins']:.2f} s, cycles {parts['cycles']:.2f} s, "
      f"leaves {parts['leaves']:.2f} s of {wall:.2f} s")
print(f"  cycles with no join or leave before them: {len(steady)}, median "
      f"{1e3 * statistics.median(steady) if steady else 0:.2f} ms; right after one: "
      f"{sum(rows.values()) - len(steady)}, {parts['cycles after a change']:.2f} s")
row_cycles = max(sum(n * c for n, c in rows.items()), 1)
print(f"  {sum(rows.values())} cycles, {row_cycles / cycles:.2f} rows a cycle, "
      f"{parts['tokens'] / row_cycles:.2f} tokens a row and cycle; "
      f"block sizes {dict(sorted(decoder.block_sizes.items()))}; compiled verifies traced: {traced}")
print(f"  cycles by rows: {dict(sorted(rows.items(), reverse=True))}")
if args.alone:
    solo_wall, solo_replies = alone(solo_policy)
    print(f"one at a time: {sum(len(t) for t in solo_replies.values()) / solo_wall:.1f} tok/s "
          f"({solo_wall:.2f} s); batch / one at a time: {solo_wall / wall * tokens / sum(map(len, solo_replies.values())):.2f}x")
    print(f"same replies: {sum(replies[r] == solo_replies[r] for r in replies)}/{len(replies)}")
if decoder.policy is not None:  # what the batch's policy believed at the end: its choices' reasons
    known = decoder.policy.costs()
    for key in sorted(k for k in known if k is not None and known[k][0]):
        seconds, samples = known[key]
        print(f"  policy's cost a cycle at <= {key} rows: " + ", ".join(
            f"{size}: {1e3 * s:.1f} ms ({samples.get(size, 0)} cycles)" for size, s in sorted(seconds.items())))
    print("  policy's expected tokens a row: " + ", ".join(
        f"{size}: {decoder.policy.expected_tokens(size):.2f}" for size in decoder.policy.sizes))
