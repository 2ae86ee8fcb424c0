"""Serving many clients: aggregate tok/s and per-request latency of our server with batching, our
server one request at a time, and mlx-lm's batched server (no draft), side by side on one machine.

    python benchmarks/serve.py [--model M] [--draft D] [--clients 1 4 8 16] [--requests 2] [--max-tokens 128]
        [--also-fixed] [--servers batched one-at-a-time mlx-lm] [--rounds N] [--stream-interval S] [--switch-interval S]

Each server runs in a process of its own on loopback (started, warmed with short requests at
each client count and one lone request of the full length, timed, stopped, one after the
other). At each client count C, C threads each send ``--requests`` streamed greedy chat
requests (HumanEval prompts, one after the other) through the official ``openai`` client.
Reported per server and C: completion tokens per second over the wall time of all C clients, and the median and 95th percentile of the time to first token and of the time
per output token after it, our servers' model thread's busy share over the run (the rest it
waited for work: for the event loop), and how many replies ran to ``--max-tokens`` (often loops, easy to draft:
they flatter a speculative server's aggregate) with their share of the tokens. Markdown on stdout;
``--json FILE`` keeps every request's figures. ``--also-fixed``: our two servers also with fixed
full blocks (``serve --no-adaptive``), to tell the adaptive policy's part. ``--rounds N`` starts
each server N times, the servers taking turns round by round (a GPU machine drifts by 20-40%
between runs: compare the medians it adds, per server and client count). ``--stream-interval S``
is passed on to our servers (``serve --stream-interval``; default: serve's). ``--switch-interval S``
starts our servers with ``sys.setswitchinterval(S)`` (Python's default: 0.005 s): how long a thread
that wants the interpreter lock waits before the one holding it is made to let go (the model
thread, building a cycle, and the event loop, streaming, share it).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import httpx
from openai import OpenAI

from mlx_dflash import use_fast_blas
from mlx_dflash.bench import humaneval_prompts
from mlx_dflash.models import DEFAULT_MODEL, fetch, shipped_draft


SERVERS = {"batched": "mlx-dflash, batched", "one-at-a-time": "mlx-dflash, one at a time",
           "mlx-lm": "mlx_lm.server, batched, no draft"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an mlx-lm model folder (default: the embedded default model)")
    parser.add_argument("--draft", default=None, help="default: the draft shipped for the default model")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=2, help="requests each client sends, one after the other")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--json", default=None, help="write every request's figures here")
    parser.add_argument("--also-fixed", action="store_true", help="our servers with fixed blocks too")
    parser.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS),
                        help="which servers to run (default: all three)")
    parser.add_argument("--rounds", type=int, default=1, help="start every server this many times, taking turns")
    parser.add_argument("--stream-interval", default=None, help="our servers' --stream-interval (default: serve's)")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="our servers' sys.setswitchinterval, seconds (default: Python's)")
    args = parser.parse_args()
    if args.rounds < 1 or args.requests < 1 or args.max_tokens < 1 or min(args.clients) < 1:
        parser.error("--rounds, --requests, --max-tokens and --clients must be at least 1")
    return args


def start(command: list[str], port: int) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited: {' '.join(command)}\n{process.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(1)
    process.kill()
    raise SystemExit(f"server did not answer in 600 s: {' '.join(command)}")


def one_request(client: OpenAI, name: str, prompt: str, max_tokens: int) -> dict:
    tic = time.perf_counter()
    first, pieces, usage, finish = None, [], None, None
    stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else len(pieces)
    first = first or end
    return {"ttft_s": first - tic, "tokens": tokens, "seconds": end - tic,
            "per_token_s": (end - first) / max(tokens - 1, 1), "text": "".join(pieces), "finish_reason": finish}


def run_clients(port: int, name: str, clients: int, requests: int, prompts: list[str], max_tokens: int) -> dict:
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=3600, max_retries=0)

    def session(c: int) -> list[dict]:
        return [one_request(client, name, prompts[(c * requests + r) % len(prompts)], max_tokens) for r in range(requests)]

    tic = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(session, range(clients)) for r in rs]
    wall = time.perf_counter() - tic
    ttft = sorted(r["ttft_s"] for r in results)
    per_token = sorted(r["per_token_s"] for r in results)
    capped = [r for r in results if r["finish_reason"] == "length"]
    total = sum(r["tokens"] for r in results)
    p95 = lambda xs: xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]  # noqa: E731
    return {"clients": clients, "tok_s": total / wall,
            "ttft_p50": statistics.median(ttft), "ttft_p95": p95(ttft),
            "per_token_p50_ms": 1000 * statistics.median(per_token), "per_token_p95_ms": 1000 * p95(per_token),
            "at_cap": len(capped), "at_cap_token_share": sum(r["tokens"] for r in capped) / max(total, 1),
            "requests": results}


def model_thread(port: int) -> Optional[dict]:
    """Our server's model thread figures (``/health``): seconds up and busy; None for mlx-lm's."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json().get("model_thread")
    except (httpx.HTTPError, ValueError):
        return None


def measure_server(label: str, command: list[str], args: argparse.Namespace, prompts: list[str]) -> list[dict]:
    """Start one server, warm it, and time it at each client count (``run_clients``' figures, with
    our server's model thread's busy share over each run); stop it."""
    process = start(command, args.port)
    results = []
    try:
        # (mlx-lm's server takes "default_model" for the model it was started with)
        served = "default_model" if label.startswith("mlx_lm") else httpx.get(
            f"http://127.0.0.1:{args.port}/v1/models").json()["data"][0]["id"]
        for clients in args.clients:  # (warm: each batch size's kernels built before timing)
            run_clients(args.port, served, clients, 1, prompts, max(8, args.max_tokens // 4))
        # and a lone client at the full length (a prompt the timed runs do not send): in the batched server
        # the warm-up's first requests move into the batch, so its single-sequence engine would otherwise
        # meet the longer caches' shapes (new traces) in the timed runs
        run_clients(args.port, served, 1, 1, prompts[-1:], args.max_tokens)
        for clients in args.clients:
            before = model_thread(args.port)
            result = run_clients(args.port, served, clients, args.requests, prompts, args.max_tokens)
            after = model_thread(args.port)
            result["model_busy_share"] = ((after["busy_s"] - before["busy_s"]) / (after["up_s"] - before["up_s"])
                                          if before and after else None)
            result["switch_interval_s"] = after["switch_interval_s"] if after else None
            results.append(result)
            print(f"{label}: {clients} clients: {result['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        process.terminate()
        process.wait(timeout=60)
    return results


def main() -> None:
    args = parse_args()
    use_fast_blas()  # (the servers inherit it: mlx-lm's on the same BLAS as ours)
    model = args.model or str(fetch(DEFAULT_MODEL))
    draft = args.draft or shipped_draft(DEFAULT_MODEL)
    most = max(*args.clients, 8)  # (the batch width: the most clients, at least serve's default)
    interpreter = [sys.executable, "-m", "mlx_dflash.cli"] if args.switch_interval is None else [
        sys.executable, "-c", f"import sys; sys.setswitchinterval({args.switch_interval!r}); "
        "from mlx_dflash.cli import main; sys.exit(main())"]
    ours = [*interpreter, "serve", "--model", model, "--draft", draft, "--port", str(args.port),
            *(["--stream-interval", args.stream_interval] if args.stream_interval is not None else [])]
    servers = {
        SERVERS["batched"]: ours + ["--decode-concurrency", str(most)],
        SERVERS["one-at-a-time"]: ours + ["--decode-concurrency", "1"],
        **({"mlx-dflash, batched, fixed blocks": ours + ["--decode-concurrency", str(most), "--no-adaptive"],
            "mlx-dflash, one at a time, fixed blocks": ours + ["--decode-concurrency", "1", "--no-adaptive"]}
           if args.also_fixed else {}),
        SERVERS["mlx-lm"]: [sys.executable, "-m", "mlx_lm.server", "--model", model,
                            "--port", str(args.port), "--decode-concurrency", str(most)],
    }
    chosen = {SERVERS[name] for name in args.servers}
    servers = {label: command for label, command in servers.items() if label.split(", fixed")[0] in chosen}
    prompts = humaneval_prompts()
    rows = [(label, result) for _ in range(args.rounds) for label, command in servers.items()
            for result in measure_server(label, command, args, prompts)]
    print("| server | clients | aggregate tok/s | TTFT p50 / p95 s | per token p50 / p95 ms | at the cap (token share) "
          "| model thread busy |")
    print("|---|---|---|---|---|---|---|")
    for label, r in rows:
        busy = "-" if r["model_busy_share"] is None else f"{r['model_busy_share']:.0%}"
        print(f"| {label} | {r['clients']} | {r['tok_s']:.1f} | {r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} | "
              f"{r['per_token_p50_ms']:.1f} / {r['per_token_p95_ms']:.1f} | "
              f"{r['at_cap']}/{len(r['requests'])} ({r['at_cap_token_share']:.0%}) | {busy} |")
    if args.rounds > 1:
        print("\n| server | clients | aggregate tok/s, round by round | median |")
        print("|---|---|---|---|")
        for label in servers:
            for clients in args.clients:
                rates = [r["tok_s"] for lbl, r in rows if lbl == label and r["clients"] == clients]
                print(f"| {label} | {clients} | {' / '.join(f'{x:.1f}' for x in rates)} | {statistics.median(rates):.1f} |")
    if args.json:
        everything = {label: [r for lbl, r in rows if lbl == label] for label in servers}
        Path(args.json).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
