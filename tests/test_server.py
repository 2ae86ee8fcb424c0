"""The OpenAI-compatible server, for real: uvicorn on loopback, the official client, raw HTTP."""

import asyncio
import json
import threading
import time
from contextlib import aclosing
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import pytest
import uvicorn
from mlx_lm.sample_utils import make_logits_processors
from openai import OpenAI
from tiny_models import MASK_ID, free_port, load_tiny, make_tiny_target, wait_until_healthy

from mlx_dflash import SamplingParams, create_random_draft, generate
from mlx_dflash.batch import BatchDecoder
from mlx_dflash.generate import TextStream
from mlx_dflash.mlx_thread import MLXThread, ModelLock
from mlx_dflash.options import EngineOptions
from mlx_dflash.policy import BlockPolicy
from mlx_dflash.scheduler import BatchRequest, BatchWorker
from mlx_dflash.server import Served, create_app

NAME = "tiny"
CONTEXT = 2048


def tiny_target_and_draft(path, family: str) -> tuple:
    """(model, tokenizer, a random one-layer draft for it) of a fresh tiny target at ``path``."""
    path = make_tiny_target(path, family)
    model, tokenizer = load_tiny(path)
    config = json.loads((path / "config.json").read_text())
    return model, tokenizer, create_random_draft(config, num_layers=1, mask_token_id=MASK_ID)


@pytest.fixture(scope="module")
def server(tiny_dir):
    model, tokenizer, draft = tiny_target_and_draft(tiny_dir / "server-qwen3", "qwen3")
    tokenizer.eos_token_ids = set()  # random weights: generate to max_tokens
    port = free_port()
    app = create_app(Served(model, tokenizer, draft, NAME, CONTEXT, 1800))
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_until_healthy(base, 10)
    yield base, model, tokenizer, draft
    uv.should_exit = True
    thread.join(timeout=10)


def expected_chat(model, tokenizer, draft, messages, max_tokens):
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return generate(model, tokenizer, prompt, draft, max_tokens=max_tokens)


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Count to three."},
]


def client(base):
    return OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)


def test_the_model_thread_runs_waited_and_awaited_calls_on_one_thread():
    """``serve`` builds and warms its batch with ``call`` on the thread whose ``run`` serves the
    requests: one thread, not the caller's; closing twice (the app's shutdown, then the CLI's) is fine."""
    thread = MLXThread()
    called = thread.call(threading.get_ident)
    awaited = asyncio.run(thread.run(threading.get_ident))
    assert called == awaited != threading.get_ident()
    thread.close()
    thread.close()
    assert thread.closed


def test_a_pump_makes_items_back_to_back_on_the_thread_until_told_to_pause():
    """``pump`` runs ahead of a slow caller (each item made as the one before is handed over),
    pauses after the item where ``go_on`` turns false, goes on with the same iterator and ends
    with None; a caller that leaves early stops it after the item in progress; an error is
    raised to the caller."""
    thread, made, threads = MLXThread(), [], set()

    def items(n: int, fail_at: int = -1, seconds: float = 0.0):
        for i in range(n):
            time.sleep(seconds)
            threads.add(threading.get_ident())
            if i == fail_at:
                raise ValueError("broken")
            made.append(i)
            yield i

    async def main():
        numbers, got = items(8), []
        async with aclosing(thread.pump(numbers, lambda: len(made) < 4)) as pumped:
            async for x in pumped:
                if not got:
                    await asyncio.sleep(0.3)  # (meanwhile the thread went on to the pause)
                    ahead = len(made)
                got.append(x)
        rest = [x async for x in thread.pump(numbers, lambda: True)]
        made.clear()
        async with aclosing(thread.pump(items(100, seconds=0.01), lambda: True)) as pumped:
            async for x in pumped:
                break
        await thread.run(lambda: None)  # (after the pump's last item)
        left = len(made)
        with pytest.raises(ValueError, match="broken"):
            async for x in thread.pump(items(5, fail_at=2), lambda: True):
                pass
        busy = thread.stats()["busy_s"]
        assert [x async for x in thread.pump(items(3, seconds=0.05), lambda: True)] == [0, 1, 2, None]
        await thread.run(lambda: None)  # (the pump's call has ended and been counted)
        assert thread.stats()["busy_s"] - busy >= 0.15  # (its time counts as the thread's busy time)
        return got, ahead, rest, left, await thread.run(threading.get_ident)

    try:
        got, ahead, rest, left, ident = asyncio.run(main())
    finally:
        thread.close()
    assert (got, ahead, rest) == ([0, 1, 2, 3], 4, [4, 5, 6, 7, None])
    assert left < 50 and threads == {ident} != {threading.get_ident()}


def test_models_and_health(server):
    base = server[0]
    assert httpx.get(base + "/health").json()["status"] == "ok"
    assert [m.id for m in client(base).models.list().data] == [NAME]
    before = httpx.get(base + "/health").json()["model_thread"]
    client(base).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4)
    after = httpx.get(base + "/health").json()["model_thread"]
    assert 0 < after["busy_s"] - before["busy_s"] <= after["up_s"] - before["up_s"]  # (the reply's cycles)


def test_chat_multi_turn_equals_generate(server):
    base, model, tokenizer, draft = server
    reply = client(base).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=24)
    expected = expected_chat(model, tokenizer, draft, MESSAGES, 24)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 24
    assert reply.usage.model_extra["dflash"]["mean_acceptance_length"] >= 1


def test_chat_turns_reuse_the_prefix_cache(server):
    """Each turn resends the history: it prefills only what follows the previous turn's prompt,
    reported in usage and /health, and the replies equal cold generations."""
    base, model, tokenizer, draft = server
    before = httpx.get(base + "/health").json()["prefix_cache"]
    history, history_tokens = [{"role": "system", "content": "You are an agent. " * 20}], []
    for turn in range(3):
        history.append({"role": "user", "content": f"step {turn}: list the files"})
        reply = client(base).chat.completions.create(model=NAME, messages=history, max_tokens=12,
                                                     stream=turn == 1, **({"stream_options": {"include_usage": True}}
                                                                         if turn == 1 else {}))
        if turn == 1:
            chunks = list(reply)
            text, usage = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage
        else:
            text, usage = reply.choices[0].message.content, reply.usage
        assert text == expected_chat(model, tokenizer, draft, history, 12).text
        cached = usage.prompt_tokens_details.cached_tokens
        # the previous turn's prompt and reply were kept: at least that prompt is restored (the
        # reply as far as its text tokenizes back alike); the first turn shares its template's
        # opening with the other tests' prompts at most
        assert cached >= len(history_tokens) if turn > 0 else cached < 40
        history_tokens = tokenizer.apply_chat_template(history, add_generation_prompt=True)
        history.append({"role": "assistant", "content": text})
    after = httpx.get(base + "/health").json()["prefix_cache"]
    assert after["hits"] - before["hits"] >= 2 and after["hits"] + after["misses"] - before["hits"] - before["misses"] == 3
    assert 0 < after["bytes"] <= after["max_bytes"]


def test_a_lone_request_runs_alone_and_others_batch_beside_it(server):
    """A greedy request that arrives alone takes the single-sequence engine (the batch runs no
    cycle). Greedy requests that arrive while a generation runs there are batched, their cycles
    between its own: every reply equals its solo generation, the seeded one's included."""
    base, model, tokenizer, draft = server
    cycles = httpx.get(base + "/health").json()["batch"]["cycles"]
    reply = client(base).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10)
    assert reply.choices[0].message.content == expected_chat(model, tokenizer, draft, MESSAGES, 10).text
    assert httpx.get(base + "/health").json()["batch"]["cycles"] == cycles
    conversations = [[{"role": "user", "content": f"Beside {i}"}] for i in range(3)]
    # (solo outputs computed first: the server's model thread must be the model's only user meanwhile)
    expected = [expected_chat(model, tokenizer, draft, m, 12).text for m in conversations]
    sampled = {"model": NAME, "messages": MESSAGES, "max_tokens": 300, "temperature": 1.0, "seed": 5}
    with httpx.stream("POST", base + "/v1/chat/completions", json={**sampled, "stream": True}, timeout=120) as alone:
        lines = alone.iter_lines()
        first = next(lines)
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda m: client(base).chat.completions.create(
                model=NAME, messages=m, max_tokens=12).choices[0].message.content, conversations))
        assert answers == expected
        assert httpx.get(base + "/health").json()["batch"]["cycles"] > cycles
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in [first, *lines] if line.startswith("data: {"))
    alone_again = httpx.post(base + "/v1/chat/completions", json=sampled, timeout=120).json()
    assert text == alone_again["choices"][0]["message"]["content"]


def test_a_lone_generation_moves_into_the_batch_when_others_come(server):
    """A greedy request running alone goes on in the batch once others arrive (its prompt and
    tokens so far prefilled there): its streamed text and usage equal its solo generation's,
    and so do the others'."""
    base, model, tokenizer, draft = server
    moved = httpx.get(base + "/health").json()["batch"]["moved_in"]
    conversations = [[{"role": "user", "content": f"Join {i}"}] for i in range(2)]
    expected_long = expected_chat(model, tokenizer, draft, MESSAGES, 1000)
    expected = [expected_chat(model, tokenizer, draft, m, 12).text for m in conversations]
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 1000, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as alone:
        lines = alone.iter_lines()
        first = next(lines)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda m: client(base).chat.completions.create(
                model=NAME, messages=m, max_tokens=12).choices[0].message.content, conversations))
        chunks = [json.loads(line[6:]) for line in [first, *lines] if line.startswith("data: {")]
    assert answers == expected
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == expected_long.text
    assert chunks[-1]["usage"]["completion_tokens"] == 1000 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert httpx.get(base + "/health").json()["batch"]["moved_in"] == moved + 1


def stream_alone(worker: BatchWorker, request) -> list:
    """``request``'s responses from ``worker``, its client never leaving; the worker's thread closed after."""
    async def responses() -> list:
        async def connected() -> bool:
            return False
        return [response async for response in worker.stream(request, connected)]
    try:
        return asyncio.run(responses())
    finally:
        worker.thread.close()


def test_a_row_that_reaches_eos_leaves_the_batch_in_that_cycle(tiny_dir):
    """A batch row whose cycle commits an EOS is gone when its client reads its last tokens, so
    the client's next request finds the batch empty and runs alone (single-sequence engine)."""
    model, tokenizer, draft = tiny_target_and_draft(tiny_dir / "eos-qwen3", "qwen3")
    prompt = tokenizer.encode("Where does it end?")
    tokenizer.eos_token_ids = set()
    solo = generate(model, tokenizer, prompt, draft, max_tokens=40).tokens
    end = next(k for k in range(3, len(solo)) if solo[k] not in solo[:k])  # (a token first made there)
    tokenizer.eos_token_ids = {solo[end]}
    worker = BatchWorker(BatchDecoder(model, draft), ModelLock(), MLXThread(), max_rows=4)
    text = TextStream(tokenizer, mx.array(prompt), 40)
    stream_alone(worker, BatchRequest(prompt, 40, text))
    assert (text.tokens, text.finish_reason) == (solo[:end], "stop")  # (the EOS ends it, not in the text)
    assert not worker.busy


def test_the_batch_runs_its_cycles_back_to_back_until_someone_waits_for_a_turn(tiny_dir):
    """The batch's cycles run back to back on the model thread, each request's tokens handed over
    as its cycle ends, until someone waits for the lock: then it gives a turn after the cycle in
    progress, and goes on after it. Its tokens are the solo run's."""
    model, tokenizer, draft = tiny_target_and_draft(tiny_dir / "turns-qwen3", "qwen3")
    tokenizer.eos_token_ids = set()
    prompt = tokenizer.encode("Hand them over")
    solo = generate(model, tokenizer, prompt, draft, max_tokens=40).tokens
    worker = BatchWorker(BatchDecoder(model, draft, 4), ModelLock(), MLXThread(), max_rows=4)
    turns, run, step = [], worker.thread.run, worker.decoder.step  # (the worker's calls to the model thread: one a turn)
    asked = threading.Event()  # (cycle 3 waits for it: the turn is asked for before then)

    async def counted(*args):
        turns.append(worker.cycles)
        return await run(*args)

    def gated():
        if worker.cycles == 3:
            asked.wait(30)
        return step()
    worker.thread.run, worker.decoder.step = counted, gated

    async def serve_one() -> tuple[TextStream, list[int]]:
        text, responses, given = TextStream(tokenizer, mx.array(prompt), 40), 0, []

        async def turn() -> None:
            async with worker.lock.turn():
                given.append(worker.cycles)

        async def connected() -> bool:
            return False
        async for _ in worker.stream(BatchRequest(prompt, 40, text), connected):
            responses += 1
            if responses == 2:  # (cycle 1's tokens: now someone wants a turn)
                waiter = asyncio.get_running_loop().create_task(turn())
                await asyncio.sleep(0)
                asked.set()
        await waiter
        return text, given

    try:
        text, (given,) = asyncio.run(serve_one())
    finally:
        worker.thread.close()
    assert text.tokens == solo and worker.cycles > 6
    assert 1 <= given <= 3 and turns == [0, given], (turns, given)  # (asked after cycle 1, granted by cycle 3)


def test_a_batched_request_takes_the_cycles_ending_within_the_stream_interval_as_one_piece():
    """With a stream interval, a piece holds every cycle's tokens that came until that long after
    the previous piece; the end (or an error) ends the wait at once; without one, a piece a cycle."""
    from mlx_dflash.scheduler import BatchRequest

    async def pieces(interval: float) -> list[tuple[object, int, float]]:
        worker = BatchWorker(None, ModelLock(), None, max_rows=1, stream_interval=interval)
        request, out, start = BatchRequest([1], 8, None), [], time.perf_counter()
        request.give([1])

        async def later() -> None:  # (two cycles during the first wait, one more, then the end)
            await asyncio.sleep(0.02)
            request.give([2, 3]), request.give([4])
            await asyncio.sleep(0.4)
            request.give([5]), request.give(None)
        feeding = asyncio.get_running_loop().create_task(later())
        since = time.perf_counter()
        while True:
            item, cycles = await worker._piece(request, since)
            out.append((item, cycles, round(time.perf_counter() - start, 1)))
            since = time.perf_counter()
            if item is None:
                await feeding
                return out

    assert asyncio.run(pieces(0.3)) == [([1, 2, 3, 4], 3, 0.3), ([5], 1, 0.4), (None, 1, 0.4)]
    assert [(item, cycles) for item, cycles, _ in asyncio.run(pieces(0.0))] == [
        ([1], 1), ([2, 3], 1), ([4], 1), ([5], 1), (None, 1)]


def test_a_batched_generation_in_fewer_pieces_gives_the_same_text_and_acceptance(tiny_dir):
    """The same request through the batch with a piece a cycle and with a long stream interval:
    the same tokens and text, fewer pieces, and the same verifies and tokens a verify (usage)."""
    from mlx_dflash.server import Acceptance

    model, tokenizer, draft = tiny_target_and_draft(tiny_dir / "pieces-llama", "llama")
    tokenizer.eos_token_ids = set()
    prompt = tokenizer.encode("In pieces")
    runs = {}
    for interval in (0.0, 10.0):
        worker = BatchWorker(BatchDecoder(model, draft, 4), ModelLock(), MLXThread(), max_rows=2, stream_interval=interval)
        text = TextStream(tokenizer, mx.array(prompt), 40)
        responses = stream_alone(worker, BatchRequest(prompt, 40, text))
        acceptance = Acceptance()
        for response in responses:
            acceptance.add(response)
        runs[interval] = (text.tokens, "".join(r.text for r in responses), acceptance.tokens, acceptance.verifies,
                          responses[-1].cycle, len(responses), worker.cycles)
    (tokens, text, accepted, verifies, last, pieces, cycles), slow = runs[0.0], runs[10.0]
    assert slow[:5] == (tokens, text, accepted, verifies, last) and len(tokens) == 40 and accepted == 39
    assert verifies == last == cycles == slow[6] > 3 and pieces == cycles + 1 and slow[5] < pieces


@pytest.mark.parametrize("behind", [False, True])
def test_clients_whose_rows_end_at_eos_together_in_a_queued_adaptive_batch(tiny_dir, behind):
    """Clients each send requests in turn to a batch that queues cycles ahead (as on GPUs) and
    chooses block sizes: many EOS ids make rows end often, several in one cycle and in cycles
    read early as others join (``behind``: joining rows prefilled behind the queued cycle, their
    first tokens streamed from the next step). Every reply is the request's solo reply, and the worker stays whole."""
    model, tokenizer, draft = tiny_target_and_draft(tiny_dir / "eos-batch-llama", "llama")
    prompts = [list(range(30 + k, 36 + 3 * k)) for k in range(12)]
    tokenizer.eos_token_ids = set()
    runs = [generate(model, tokenizer, p, draft, max_tokens=24).tokens for p in prompts]
    counts = Counter(t for run in runs for t in run[2:])
    tokenizer.eos_token_ids = {t for t, _ in counts.most_common(6)}  # (common: rows end often, many together)
    solo = [generate(model, tokenizer, p, draft, max_tokens=24).tokens for p in prompts]
    options = EngineOptions(queue_ahead=True, compile_blocks=True, join_behind=behind)
    decoder = BatchDecoder(model, draft, 8, policy=BlockPolicy(8), options=options)
    worker = BatchWorker(decoder, ModelLock(), MLXThread(), max_rows=4)
    queued_at_join, add = [], decoder.add
    decoder.add = lambda *args, **kwargs: queued_at_join.append(decoder.queued is not None) or add(*args, **kwargs)

    async def client(mine: list[int]) -> list[list[int]]:
        replies = []
        for i in mine:
            text = TextStream(tokenizer, mx.array(prompts[i]), 24)

            async def connected() -> bool:
                return False
            async for _ in worker.stream(BatchRequest(prompts[i], 24, text), connected):
                pass
            replies.append(text.tokens)
        return replies

    async def clients() -> list:
        return await asyncio.gather(*(client(list(range(c, len(prompts), 4))) for c in range(4)))

    try:
        replies = asyncio.run(clients())
    finally:
        worker.thread.close()
    assert decoder.target.rolls_back_on_device and not worker.busy
    assert {i: reply for c, rs in enumerate(replies) for i, reply in zip(range(c, len(prompts), 4), rs)} == {
        i: tokens for i, tokens in enumerate(solo)}
    assert sum(len(t) < 24 for t in solo) >= 6  # (most ended at an EOS)
    assert any(queued_at_join)  # (rows joined while a cycle was queued)


def test_chat_streaming_equals_generate(server):
    base, model, tokenizer, draft = server
    chunks = list(client(base).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=24, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_chat(model, tokenizer, draft, MESSAGES, 24).text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", None]  # (the first delta names it)


def test_completions_with_stop(server):
    base, model, tokenizer, draft = server
    full = generate(model, tokenizer, "abc", draft, max_tokens=30).text
    stop = next(full[i : i + 2] for i in range(5, 25) if full[i : i + 2].isascii() and full[i : i + 2].isprintable())
    reply = client(base).completions.create(model=NAME, prompt="abc", max_tokens=30, stop=[stop])
    assert reply.choices[0].text == full[: full.find(stop)]
    assert reply.choices[0].finish_reason == "stop"
    streamed = client(base).completions.create(model=NAME, prompt="abc", max_tokens=30, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[: full.find(stop)]


def test_sampling_is_honoured_and_seeded(server):
    base = server[0]
    c = client(base)
    runs = [c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=1.0, seed=3)
            .choices[0].message.content for _ in range(2)]
    greedy = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20).choices[0].message.content
    assert runs[0] == runs[1] and runs[0] != greedy


def test_penalties_and_logit_bias_are_mlx_lm_logits_processors(server):
    """OpenAI's presence/frequency penalties and logit bias, mlx-lm's repetition penalty: the
    reply is generate's with mlx-lm's processors (greedy), also when asked beside other requests
    (processors read each row's own history: such a request runs alone); a bias of +100 makes the
    reply that one token."""
    base, model, tokenizer, draft = server
    settings = {"repetition_penalty": 1.5, "repetition_context_size": 8, "presence_penalty": 1.0,
                "frequency_penalty": 0.5, "logit_bias": {"7": 3.0, "11": -2.0}}
    processors = make_logits_processors(repetition_penalty=1.5, repetition_context_size=8, presence_penalty=1.0,
                                        frequency_penalty=0.5, logit_bias={7: 3.0, 11: -2.0})
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    expected = generate(model, tokenizer, prompt, draft, max_tokens=16,
                        sampling=SamplingParams(logits_processors=processors)).text
    assert expected != expected_chat(model, tokenizer, draft, MESSAGES, 16).text
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 16, **settings}
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda b: httpx.post(base + "/v1/chat/completions", json=b, timeout=60).json(),
                                [body, {**body, "messages": [{"role": "user", "content": "other"}]}, body]))
    assert [replies[0]["choices"][0]["message"]["content"], replies[2]["choices"][0]["message"]["content"]] == \
        [expected, expected]
    forced = client(base).completions.create(model=NAME, prompt="abc", max_tokens=6, logit_bias={"65": 100})
    assert forced.choices[0].text == tokenizer.decode([65] * 6)


def test_completions_take_token_ids_and_unused_fields(server):
    """A completion's prompt may be token ids (or a list of one string); fields this server does
    not implement are accepted with the values that mean "not used"."""
    base, model, tokenizer, draft = server
    ids = tokenizer.encode("abc")
    expected = generate(model, tokenizer, ids, draft, max_tokens=8).text
    unused = {"logprobs": None, "echo": False, "best_of": 1, "suffix": None}
    for prompt in (ids, ["abc"]):
        reply = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 8, **unused},
                           timeout=60).json()
        assert reply["choices"][0]["text"] == expected
    for bad in ([], [1, -1], [1, 10**9], ["a", "b"], [1.5]):
        r = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": bad, "max_tokens": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "a", "echo": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    chat = {"model": NAME, "messages": MESSAGES, "max_tokens": 4, "tools": [], "logprobs": False,
            "response_format": {"type": "text"}, "stream_options": None}
    assert httpx.post(base + "/v1/chat/completions", json=chat, timeout=60).status_code == 200


def test_a_job_crosses_to_the_other_processes_whole():
    """A sharded target's processes get each job as JSON: its penalties and logit bias too."""
    from mlx_dflash.server import Job, job_from_payload, job_payload

    processors = {"repetition_penalty": 1.2, "repetition_context_size": 4, "presence_penalty": 0.5,
                  "presence_context_size": 20, "frequency_penalty": -0.5, "frequency_context_size": 20,
                  "logit_bias": [[3, 2.0]]}
    sampling = {"temp": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "seed": 4, "processors": processors}
    job = Job([1, 2, 3], 5, ["x"], sampling, True, False)
    again = job_from_payload(json.loads(json.dumps(job_payload(job))))
    logits, history = mx.random.normal((1, 16), key=mx.random.key(0)), mx.array([3, 3, 5])
    ours, theirs = job.sampling_params, again.sampling_params
    assert (ours.temp, ours.top_p, ours.seed) == (theirs.temp, theirs.top_p, theirs.seed)
    assert mx.array_equal(ours.process_row(logits, history), theirs.process_row(logits, history))
    assert not mx.array_equal(ours.process_row(logits, history), logits)


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
        (json.dumps({"model": "gpt-9", "messages": MESSAGES}).encode(), 404, "does not exist"),
        (json.dumps({"messages": []}).encode(), 400, "non-empty"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "role"),
        (json.dumps({"messages": MESSAGES, "max_tokens": -5}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": MESSAGES, "max_tokens": 10**12}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": MESSAGES, "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 2100}], "max_tokens": 8}).encode(), 400,
         "context limit"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"messages": MESSAGES, "logprobs": True}).encode(), 400, "'logprobs' is not supported"),
        (json.dumps({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}).encode(),
         400, "has no tool calling"),
        (json.dumps({"messages": MESSAGES, "response_format": {"type": "json_object"}}).encode(), 400,
         "'response_format' is not supported"),
        (json.dumps({"messages": MESSAGES, "presence_penalty": "a"}).encode(), 400, "presence_penalty"),
        (json.dumps({"messages": MESSAGES, "repetition_penalty": -1}).encode(), 400, "repetition_penalty"),
        (json.dumps({"messages": MESSAGES, "logit_bias": {"999999": 5}}).encode(), 400, "logit_bias"),
        (json.dumps({"messages": MESSAGES, "logit_bias": {"5": 101}}).encode(), 400, "logit_bias"),
        (json.dumps({"messages": MESSAGES, "stream_options": "yes"}).encode(), 400, "stream_options"),
    ],
)
def test_bad_input_gets_openai_style_4xx(server, body, status, words):
    base = server[0]
    r = httpx.post(base + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(base + "/health").status_code == 200  # still serving


def test_disconnect_mid_stream_stops_generation_and_frees_the_server(server):
    base, model, tokenizer, draft = server
    expected = expected_chat(model, tokenizer, draft, MESSAGES, 8).text  # (before: the server's thread alone then)
    cancelled = httpx.get(base + "/health").json()["cancelled"]
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 1800, "stream": True}  # many seconds of work
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    # the client is gone after one event: its generation stops and the next request runs
    tic = time.perf_counter()
    reply = client(base).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8)
    assert reply.choices[0].message.content == expected
    assert time.perf_counter() - tic < 30
    assert httpx.get(base + "/health").json()["cancelled"] == cancelled + 1


def test_concurrent_clients_all_get_generate_text(server):
    base, model, tokenizer, draft = server
    conversations = [[{"role": "user", "content": f"Question number {i}"}] for i in range(4)]
    expected = [expected_chat(model, tokenizer, draft, m, 16).text for m in conversations]

    def ask(messages):
        return client(base).chat.completions.create(model=NAME, messages=messages, max_tokens=16).choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, conversations, timeout=120))
    assert answers == expected


def test_load_64_requests_from_16_clients(server):
    """Mixed lengths, streaming and not, greedy and sampled (batched; seeded ones one at a time),
    and a client that leaves mid-stream: every request completes, each greedy reply equals its
    solo generation, each seeded one its reply when asked again alone, and the server still
    reports itself healthy with an empty batch."""
    base, model, tokenizer, draft = server
    cancelled = httpx.get(base + "/health").json()["cancelled"]
    jobs = [([{"role": "user", "content": f"request {i}: " + "tell me more " * (i % 5)}], 4 + 7 * (i % 4), i % 4 == 3,
             i % 2 == 0) for i in range(64)]  # (messages, max_tokens, sampled, streamed)
    expected = {i: expected_chat(model, tokenizer, draft, m, n).text for i, (m, n, sampled, _) in enumerate(jobs)
                if not sampled}

    def ask(i):
        messages, max_tokens, sampled, streamed = jobs[i]
        extra = ({"temperature": 0.8, "seed": i} if i % 8 == 3 else {"temperature": 0.8, "top_p": 0.9}) if sampled else {}
        if not streamed:
            reply = client(base).chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, **extra)
            return reply.choices[0].message.content, reply.choices[0].finish_reason
        chunks = list(client(base).chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens,
                                                           stream=True, **extra))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].choices[0].finish_reason

    def leave_mid_stream():
        body = {"model": NAME, "messages": jobs[0][0], "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
            next(r.iter_lines())

    with ThreadPoolExecutor(16) as pool:
        leaving = pool.submit(leave_mid_stream)
        answers = list(pool.map(ask, range(64), timeout=600))
        leaving.result()
    assert all(finish == "length" for _, finish in answers)
    assert {i: answers[i][0] for i in expected} == expected
    seeded = [i for i in range(64) if jobs[i][2] and i % 8 == 3]  # (their draws their own: as when asked alone)
    assert [ask(i) for i in seeded] == [answers[i] for i in seeded]
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ok" and (health["batch"]["rows"], health["batch"]["waiting"]) == (0, 0)
    assert health["batch"]["peak_rows"] > 4  # (the greedy requests were decoded together)
    sizes = {int(size): cycles for size, cycles in health["batch"]["block_sizes"].items()}
    assert sizes and all(1 <= size <= 16 for size in sizes) and sum(sizes.values()) >= health["batch"]["cycles"] // 2
    # The leaver's generation ends too, before the next test computes on its own thread beside this server's.
    deadline = time.monotonic() + 30
    while httpx.get(base + "/health").json()["cancelled"] == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(base + "/health").json()["cancelled"] == cancelled + 1


def test_a_request_whose_prefill_fails_fails_alone(tiny_dir):
    """A batched request that fails (here: its prefill raises) gets a server error; the requests
    batched beside it complete with their solo outputs."""
    from mlx_dflash.batch import BatchDecoder

    path = make_tiny_target(tiny_dir / "server-failing", "qwen3")
    model, tokenizer = load_tiny(path)
    tokenizer.eos_token_ids = set()
    draft = create_random_draft(json.loads((path / "config.json").read_text()), num_layers=1, mask_token_id=MASK_ID)
    served = Served(model, tokenizer, draft, NAME, CONTEXT, 1800)

    asked = len(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))

    class FailingPrefill(BatchDecoder):
        def add(self, prompt, max_tokens, params=None, eos=frozenset()):
            # (the request of max_tokens 13, also if it moved in from running alone with its tokens as prompt)
            if prompt.size + max_tokens == asked + 13:
                raise RuntimeError("out of memory")
            return super().add(prompt, max_tokens, params, eos)

    served.batch = FailingPrefill(model, draft, prefix_cache=served.prefix_cache)
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(create_app(served), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_until_healthy(base, 10)
    expected = {n: expected_chat(model, tokenizer, draft, MESSAGES, n).text for n in (12, 14, 15)}
    try:
        def ask(max_tokens):
            body = {"model": NAME, "messages": MESSAGES, "max_tokens": max_tokens}
            return httpx.post(base + "/v1/chat/completions", json=body, timeout=120)

        # (a long sampled generation holds the single-sequence path, so that all four go to the batch)
        body = {"model": NAME, "messages": MESSAGES, "max_tokens": 1000, "stream": True, "temperature": 1.0}
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as alone:
            lines = alone.iter_lines()  # (kept: a dropped line iterator closes the connection)
            next(lines)
            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(ask, [12, 13, 14, 15]))
        assert [r.status_code for r in replies] == [200, 500, 200, 200]
        assert "out of memory" in replies[1].json()["error"]["message"]
        for reply, n in zip([replies[0], *replies[2:]], [12, 14, 15]):
            assert reply.json()["choices"][0]["message"]["content"] == expected[n]
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def test_ctrl_c_after_concurrent_requests_exits_cleanly(tiny_dir):
    """`mlx-dflash serve` as a user runs it: requests at once (batched and alone), then Ctrl-C.
    The process ends as an interrupted command does (status 130); it used to abort at exit
    ("terminate called without an active exception", 134) after model calls from many worker
    threads (``mlx_thread.py``)."""
    import signal
    import subprocess
    import sys

    from tiny_models import tiny_pair_files

    target, draft = tiny_pair_files(tiny_dir / "serve-exit", "qwen3")
    port = free_port()
    # (Ctrl-C's default action, as in a user's terminal: a run started in the background inherits it ignored)
    server = subprocess.Popen([sys.executable, "-m", "mlx_dflash.cli", "serve", "--model", target, "--draft", draft,
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, 120)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: client(base).completions.create(
                model=target, prompt=f"def f{i}(x):", max_tokens=12, temperature=0.5 * (i % 2)), range(4)))
        # (a sampled reply may end at once: its text can be empty; the greedy ones are fixed)
        assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)
        assert all(a.choices[0].text for a in answers[::2])
    finally:
        server.send_signal(signal.SIGINT)
        output = server.communicate(timeout=60)[0]
    assert server.returncode == 130 and "terminate called" not in output, output[-2000:]
