"""``mlx-dflash serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Requests are decoded together (continuous batching, ``scheduler.py``): they join and leave a
batch between its cycles, and each cycle verifies every row in one target forward. A request
that arrives alone runs on the single-sequence engine (faster for one sequence) until others
come, then moves into the batch; requests the batch cannot take (a seed, logits processors;
targets and drafts ``batch.py`` does not batch) run there to their end, one at a time beside
the batch. Every model call runs on the server's one model thread (``mlx_thread.py``) holding
a lock (FIFO): a generation runs its cycles back to back there until someone else waits for a
turn, then gives it one after the cycle in progress. The event loop stays free meanwhile to
stream tokens and to notice a client that disconnects; its row or generation stops at the next
cycle.
Bad requests get a 4xx with an OpenAI-style error body and the server keeps serving. With a
target sharded over processes (``mlx.launch``), process 0 serves and sends each job to the
others, which generate it alongside (``follow``); a generation then always runs to its end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Union

import anyio
import mlx.core as mx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from mlx_lm.sample_utils import make_logits_processors
from starlette.exceptions import HTTPException as StarletteHTTPException

from .batch import BatchDecoder, batches
from .distributed import receive_job, send_job, sharding_group
from .generate import StreamResponse, TextStream, encode_prompt, stream_generate
from .errors import DFlashError
from .mlx_thread import MLXThread, ModelLock
from .policy import BlockPolicy, check_tree_budget, fixed_tree_budget, tree_budgets
from .prefix_cache import DEFAULT_SIZE, PrefixCache, parse_bytes
from .scheduler import DEFAULT_STREAM_INTERVAL, BatchRequest, BatchWorker
from .sampling import MAX_SEED, SamplingParams
from .target import text_args
from .tool_calls import ToolCallText

ROLES = {"system", "user", "assistant", "tool"}
DEFAULT_MAX_TOKENS = 256


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


@dataclass
class Served:
    model: Any
    tokenizer: Any
    draft: Any
    name: str
    context_limit: int
    max_tokens_limit: int
    adaptive: bool = True  # plain decoding while drafts lose (same output either way)
    block_size: Optional[int] = None  # the largest block (default: the draft's)
    trees: Union[bool, int] = False  # tree verification (``stream_generate``'s ``trees``)
    prefix_cache_bytes: int = field(default_factory=lambda: parse_bytes(DEFAULT_SIZE))  # 0: no prefix cache
    decode_concurrency: int = 8  # greedy requests decoded together (``batch.py``); 1: one at a time
    stream_interval: float = DEFAULT_STREAM_INTERVAL  # a batched request's tokens go out together within it (``scheduler.py``)

    def __post_init__(self) -> None:
        # one block policy for all requests: the costs it measured carry over (policy.py)
        block_size = self.block_size or self.draft.block_size
        self.policy = BlockPolicy(block_size, tree_budgets=tree_budgets(self.trees)) if self.adaptive else None
        if not self.adaptive and fixed_tree_budget(self.trees) is not None:  # (a policy checks its own)
            check_tree_budget(fixed_tree_budget(self.trees), block_size, fixed=True)
        self.group = sharding_group(self.model)  # a sharded target's processes: the others follow (``follow``)
        # prompt states that later requests starting with the same tokens reuse (prefix_cache.py)
        self.prefix_cache = PrefixCache(self.prefix_cache_bytes)
        self.batch = None  # the decoder of greedy requests, where the pair can batch (``scheduler.py``)
        self.unbatched = self._unbatched()  # why not (None: batched)
        if self.unbatched is None:
            try:
                batch_policy = BlockPolicy(block_size) if self.adaptive else None  # (its own: a batch's costs)
                self.batch = BatchDecoder(self.model, self.draft, block_size, self.prefix_cache, batch_policy)
            except DFlashError as exc:  # (this family or draft runs one request at a time)
                self.unbatched = str(exc)

    def _unbatched(self) -> Optional[str]:
        if self.decode_concurrency <= 1:
            return "--decode-concurrency 1"
        if self.group is not None:
            return "a sharded target"
        if self.trees is not False:
            return "tree verification (the batch verifies chains)"
        return None


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    stop: list[str]
    sampling: Optional[dict]  # SamplingParams' fields, and ``processors``: make_logits_processors' (None: greedy)
    chat: bool
    stream: bool
    tools: Optional[list] = None  # the chat's tool definitions: replies are parsed for calls (``tool_calls.py``)

    @functools.cached_property
    def sampling_params(self) -> Optional[SamplingParams]:
        """The request's sampling (built once: the route to the batch and the generation read it)."""
        if self.sampling is None:
            return None
        fields = dict(self.sampling)
        processors = dict(fields.pop("processors"))
        bias = processors.pop("logit_bias")  # ([id, bias] pairs: JSON keeps no int keys)
        return SamplingParams(**fields, logits_processors=make_logits_processors(
            logit_bias=dict(bias) if bias else None, **processors))


def _number(body: dict, key: str, kind, default, low, high):
    value = body.get(key, default)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value
            or (kind is int and not (isinstance(value, int) or float(value).is_integer()))):
        raise RequestError(400, f"'{key}' must be {'an integer' if kind is int else 'a number'}", key)
    if not low <= value <= high:
        raise RequestError(400, f"'{key}' must be between {low} and {high}, got {value}", key)
    return kind(value)


def _text(value: Any, key: str) -> str:
    """A request string that the tokenizer can take (JSON allows lone surrogates; UTF-8 does not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, f"'{key}' holds a lone surrogate (invalid Unicode)", key) from None
    return value


def _content(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return _text(content, "messages")
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
            raise RequestError(400, "only text content parts ({'type': 'text', 'text': ...}) are supported",
                               "messages")
        return "".join(_text(part["text"], "messages") for part in content)
    raise RequestError(400, "each message needs a string 'content' or a list of text parts", "messages")


def _turn(message: dict) -> dict:
    """A message as the chat template takes it; an assistant's earlier tool calls and a tool's
    reply keep what templates read of them (arguments as objects, as mlx-lm's server passes them)."""
    calls = message.get("tool_calls")
    content = message.get("content")
    turn = {"role": message["role"], "content": "" if content is None and (calls or message["role"] == "tool")
            else _content(content)}
    if calls is not None:
        if message["role"] != "assistant" or not isinstance(calls, list):
            raise RequestError(400, "'tool_calls' must be a list, in an assistant message", "messages")
        turn["tool_calls"] = [_earlier_call(call) for call in calls]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            turn[key] = message[key]
    return turn


def _earlier_call(call: Any) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(400, "each tool call needs a 'function' with a 'name'", "messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise RequestError(400, "a tool call's 'arguments' must be a JSON object", "messages") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _chat_prompt(served: Served, messages: Any, tools: Optional[list]) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    if not all(isinstance(m, dict) and m.get("role") in ROLES for m in messages):
        raise RequestError(400, "each message needs a 'role' (system, user, assistant or tool)", "messages")
    return encode_prompt(served.tokenizer, [_turn(m) for m in messages], tools=tools).tolist()


def _tools(served: Served, body: dict, chat: bool) -> Optional[list]:
    """The request's tool definitions (None: no tools, or ``tool_choice`` "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if tools in (None, []):
        return None
    if not chat:
        raise RequestError(400, "'tools' needs /v1/chat/completions", "tools")
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type") == "function"
                                              and isinstance(t.get("function"), dict)
                                              and isinstance(t["function"].get("name"), str) for t in tools):
        raise RequestError(400, "'tools' must be a list of {'type': 'function', 'function': {'name': ...}}", "tools")
    if choice not in ("auto", "none"):  # ("required" or one named function: generation cannot be made to call)
        raise RequestError(400, "'tool_choice' may be 'auto' or 'none' on this server", "tool_choice",
                           "unsupported_parameter")
    if not getattr(served.tokenizer, "has_tool_calling", False):
        raise RequestError(400, f"model '{served.name}' has no tool calling in its chat template", "tools")
    return tools if choice == "auto" else None


PENALTIES = {"repetition": (0.0, 10.0), "presence": (-2.0, 2.0), "frequency": (-2.0, 2.0)}  # their ranges


def _processors(body: dict, vocab_size: int) -> dict:
    """mlx_lm.server's penalties (repetition: multiplicative, 0 = off; presence and frequency:
    OpenAI's additive ones; each over the last ``*_context_size`` tokens) and OpenAI's
    ``logit_bias``: arguments of mlx-lm's ``make_logits_processors``."""
    settings: dict[str, Any] = {}
    for name, (low, high) in PENALTIES.items():
        settings[f"{name}_penalty"] = _number(body, f"{name}_penalty", float, 0.0, low, high)
        settings[f"{name}_context_size"] = _number(body, f"{name}_context_size", int, 20, 1, 1 << 20)
    bias = body.get("logit_bias") or {}
    message = f"'logit_bias' must map token ids (0..{vocab_size - 1}) to numbers in [-100, 100]"
    if not isinstance(bias, dict):
        raise RequestError(400, message, "logit_bias")
    settings["logit_bias"] = []
    for key, value in bias.items():
        if (not key.isdigit() or int(key) >= vocab_size or isinstance(value, bool)
                or not isinstance(value, (int, float)) or not -100 <= value <= 100):
            raise RequestError(400, message, "logit_bias")
        settings["logit_bias"].append([int(key), float(value)])
    return settings


def _sampling(body: dict, vocab_size: int) -> Optional[dict]:
    temp = _number(body, "temperature", float, 0.0, 0.0, 2.0)
    top_p = _number(body, "top_p", float, 1.0, 0.0, 1.0)
    top_k = _number(body, "top_k", int, 0, 0, 1 << 30)
    min_p = _number(body, "min_p", float, 0.0, 0.0, 1.0)
    seed = _number(body, "seed", int, None, 0, MAX_SEED)
    processors = _processors(body, vocab_size)
    if temp == 0 and not processors["logit_bias"] and not any(processors[f"{n}_penalty"] for n in PENALTIES):
        return None
    return {"temp": temp, "top_p": top_p if top_p < 1 else 0.0, "top_k": top_k, "min_p": min_p, "seed": seed,
            "processors": processors}


# Fields of OpenAI's API this server does not implement, and the values that mean "not used".
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "functions": (None, []),
               "response_format": (None, {"type": "text"}), "echo": (None, False), "suffix": (None, ""),
               "best_of": (None, 1)}


def _check_unsupported(body: dict) -> None:
    """A field asking for what this server does not do fails the request (its reply would
    silently lack what the client asked for)."""
    for key, unused in UNSUPPORTED.items():
        if key in body and body[key] not in unused:
            raise RequestError(400, f"'{key}' is not supported by this server", key, "unsupported_parameter")


def _completion_prompt(served: Served, prompt: Any, vocab_size: int) -> list[int]:
    """A completion's prompt: a string, a list of one string, or token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return served.tokenizer.encode(_text(prompt, "prompt"))
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt)):
        return prompt
    raise RequestError(400, f"'prompt' must be a non-empty string (one per request) or a list of token ids "
                       f"(0..{vocab_size - 1})", "prompt")


def parse_job(served: Served, raw: bytes, chat: bool) -> Job:
    """Validate a request body into a Job; every problem is a RequestError (4xx)."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise RequestError(400, "request body is not valid UTF-8") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    model = body.get("model", served.name)
    if model != served.name:
        raise RequestError(404, f"model '{model}' does not exist; this server serves '{served.name}'", "model",
                           "model_not_found")
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise RequestError(400, "'n' must be 1: this server returns one choice per request", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream")
    if not isinstance(body.get("stream_options") or {}, dict):  # (usage ends every stream: include_usage or not)
        raise RequestError(400, "'stream_options' must be an object", "stream_options")
    _check_unsupported(body)
    vocab_size = text_args(served.model).vocab_size
    tools = _tools(served, body, chat)
    prompt = (_chat_prompt(served, body.get("messages"), tools) if chat
              else _completion_prompt(served, body.get("prompt"), vocab_size))
    limit_key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    default = max(1, min(DEFAULT_MAX_TOKENS, served.max_tokens_limit, served.context_limit - len(prompt)))
    max_tokens = _number(body, limit_key, int, default, 1, served.max_tokens_limit)
    if len(prompt) + max_tokens > served.context_limit:
        raise RequestError(400, f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                           f"limit of {served.context_limit} tokens", "messages" if chat else "prompt",
                           "context_length_exceeded")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise RequestError(400, "'stop' must be a string or a list of at most 4 strings", "stop")
    stop = [_text(s, "stop") for s in stop]
    return Job(prompt, max_tokens, stop, _sampling(body, vocab_size), chat, stream, tools)


def job_payload(job: Job) -> dict:
    """What the other processes of a sharded target need to generate a job alongside."""
    return {"prompt": job.prompt, "max_tokens": job.max_tokens, "stop": job.stop, "chat": job.chat,
            "sampling": job.sampling}


def job_from_payload(payload: dict) -> Job:
    return Job(payload["prompt"], payload["max_tokens"], payload["stop"], payload["sampling"], payload["chat"],
               stream=False)


def generations(served: Served) -> Callable[[Job], Iterator]:
    """``stream(job)``: a job's streamed generation (with ``served.policy``)."""
    block_size = served.block_size or served.draft.block_size
    adaptive = served.policy or False

    def stream(job: Job) -> Iterator:
        # (a completion continues its prompt exactly: its first token keeps a leading space)
        return stream_generate(served.model, served.tokenizer, job.prompt, served.draft,
                               max_tokens=job.max_tokens, block_size=block_size, stop=job.stop,
                               sampling=job.sampling_params, adaptive=adaptive, continuation=not job.chat,
                               trees=served.trees, prefix_cache=served.prefix_cache)
    return stream


def follow(served: Served) -> None:
    """A sharded target's other processes: generate each job process 0 serves, alongside it,
    until it sends none."""
    stream = generations(served)
    while (payload := receive_job(served.group)) is not None:
        for _ in stream(job_from_payload(payload)):
            pass


class Acceptance:
    """The tokens a generation's verifies committed, over its pieces (a piece may hold several verifies')."""

    def __init__(self) -> None:
        self.tokens = self.verifies = 0

    def add(self, response: StreamResponse) -> None:
        if response.acceptance_length:
            self.tokens, self.verifies = self.tokens + response.acceptance_length, self.verifies + response.verifies


def _usage(job: Job, completion_tokens: int, acceptance: Acceptance, last) -> dict:
    tps = last.decode_tokens_per_sec if last is not None else 0.0
    return {
        "prompt_tokens": len(job.prompt),
        "completion_tokens": completion_tokens,
        "total_tokens": len(job.prompt) + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": last.reused_prompt_tokens if last is not None else 0},
        "dflash": {
            "cycles": acceptance.verifies,
            "mean_acceptance_length": acceptance.tokens / acceptance.verifies if acceptance.verifies else 0.0,
            "decode_tokens_per_sec": tps,
        },
    }


def _finish_reason(last, calls: Optional[ToolCallText]) -> str:
    """OpenAI's: "length" at max_tokens, "tool_calls" after a reply that called tools, else "stop"."""
    if last is not None and last.finish_reason == "length":
        return "length"
    return "tool_calls" if calls is not None and calls.count else "stop"


def _chunk(job: Job, rid: str, created: int, name: str, text: str, finish: Optional[str], usage=None,
           first: bool = False, calls: Optional[list] = None) -> dict:
    """A streamed event; a chat's ``first`` names the role, as OpenAI's first delta does."""
    if job.chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text else {})
        delta |= {"tool_calls": calls} if calls else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": name, "choices": [choice]}
    if usage is not None:
        out["usage"] = usage
    return out


def create_app(served: Served, thread: Optional[MLXThread] = None) -> FastAPI:
    """The server's app; ``thread``: the model thread ``served`` was built on (default: a new one),
    closed when the app shuts down."""
    thread = thread or MLXThread()  # every model call runs on it

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        thread.close()

    app = FastAPI(title="mlx-dflash", lifespan=lifespan)
    lock = ModelLock()  # a turn on the model thread; waiters are served in arrival order
    counts = {"completed": 0, "cancelled": 0}  # generations, reported by /health
    generate_job = generations(served)

    def stream(job: Job) -> Iterator:
        if served.group is not None:  # the other processes generate it alongside (``follow``)
            send_job(job_payload(job), served.group)
        return generate_job(job)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # 404, 405: one error shape everywhere
        return error_response(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    worker = (BatchWorker(served.batch, lock, thread, served.decode_concurrency, served.stream_interval)
              if served.batch is not None else None)

    solo = asyncio.Lock()  # one generation outside the batch at a time

    async def in_batch(job: Job, request: Request, sent: list[int]) -> AsyncIterator[StreamResponse]:
        """``job``'s responses from the batch; ``sent``: the tokens it already sent from the
        single-sequence engine (a generation moved in: the batch prefills them with the prompt)."""
        text = TextStream(served.tokenizer, mx.array(job.prompt), job.max_tokens, job.stop, not job.chat)
        text.add(sent)  # (the text they made was sent: it holds back what it held back then)
        batch_request = BatchRequest(job.prompt + sent, job.max_tokens - len(sent), text, job.sampling_params)
        try:
            async for response in worker.stream(batch_request, request.is_disconnected):
                yield response
        finally:
            counts["completed" if text.finish_reason else "cancelled"] += 1

    async def run(job: Job, request: Request) -> AsyncIterator[StreamResponse]:
        """Responses of one generation; stops when the client goes away. A request joins the
        batch where there is one, unless it is the only request (then it runs alone, on the
        single-sequence engine: queued cycles, compiled blocks, until others come) or the batch
        cannot take how it samples (``batch.batches``: a seed, the batch's block sizes would
        change its draws; logits processors)."""
        batchable = worker is not None and batches(job.sampling_params)
        if batchable and (worker.busy or solo.locked()):
            async for response in in_batch(job, request, []):
                yield response
            return
        # Cycles back to back on the model thread until someone waits for the lock: then the
        # batch's cycles run between this one's (and count in the cycle times its policy sees,
        # each capped at 1.5x a size's cost: ``policy.SPIKE_CAP``).
        sent, reused, finished, gone, moving = [], 0, False, False, False

        def go_on() -> bool:  # (asked on the model thread after each cycle)
            return not (gone or lock.waiting or (batchable and worker.busy))

        async with solo:
            responses = stream(job)
            try:
                while not (finished or gone or (batchable and worker.busy)):
                    async with lock.turn(), aclosing(thread.pump(responses, go_on)) as cycles:
                        async for response in cycles:
                            if response is None:
                                finished = True
                            elif not gone:
                                yield response
                                sent += response.tokens
                                reused = response.reused_prompt_tokens
                                finished = response.finish_reason is not None
                                gone = await request.is_disconnected()
                # Others came: it goes on in the batch, one cycle for all (here, every batch cycle
                # would wait for one of this generation's).
                moving = not (finished or gone)
            finally:  # (shielded: a client gone cancels this task, and it must still clean up)
                with anyio.CancelScope(shield=True):
                    async with lock.turn():
                        if served.group is not None and not finished:  # the others run it to its end: so must we
                            await thread.run(lambda: all(True for _ in responses))
                        await thread.run(responses.close)  # (its end stores the reply in the prefix cache)
                if not moving:
                    counts["completed" if finished else "cancelled"] += 1
        if moving:
            async for response in in_batch(job, request, sent):  # (usage reports its prompt's reuse, not the move's)
                yield dataclasses.replace(response, reused_prompt_tokens=reused)

    @app.get("/health")
    async def health():
        batch = worker.stats() if worker is not None else None
        return {"status": "ok", **counts, "prefix_cache": served.prefix_cache.stats(), "batch": batch,
                "model_thread": thread.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "mlx-dflash"}]}

    async def complete(request: Request, chat: bool):
        try:
            job = parse_job(served, await request.body(), chat)
        except RequestError as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code)
        except DFlashError as exc:
            return error_response(400, str(exc))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        calls = ToolCallText(served.tokenizer, job.tools, streaming=job.stream) if job.tools else None
        if job.stream:
            async def events():
                tokens, acceptance, last, sent = 0, Acceptance(), None, False
                try:
                    async for r in run(job, request):
                        last, tokens = r, tokens + len(r.tokens)
                        acceptance.add(r)
                        text, made = calls.add(r.text) if calls is not None else (r.text, [])
                        if text or made:
                            chunk = _chunk(job, rid, created, served.name, text, None, first=not sent, calls=made)
                            sent = True
                            yield f"data: {json.dumps(chunk)}\n\n"
                except Exception as exc:  # after the 200: the error goes in the stream, as OpenAI's does
                    error = {"message": f"{type(exc).__name__}: {exc}", "type": "server_error", "param": None,
                             "code": None}
                    yield f"data: {json.dumps({'error': error})}\n\n"
                    return
                if last is not None:
                    text, made = calls.finish() if calls is not None else ("", [])
                    finish = _finish_reason(last, calls)
                    usage = _usage(job, tokens, acceptance, last)
                    chunk = _chunk(job, rid, created, served.name, text, finish, usage, first=not sent, calls=made)
                    yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        pieces, tokens, acceptance, last = [], 0, Acceptance(), None
        async for r in run(job, request):
            pieces.append(r.text)
            last, tokens = r, tokens + len(r.tokens)
            acceptance.add(r)
        text, made = calls.whole("".join(pieces)) if calls is not None else ("".join(pieces), [])
        finish = _finish_reason(last, calls)
        usage = _usage(job, tokens, acceptance, last)
        if chat:
            message = {"role": "assistant", "content": text if text or not made else None}
            choice = {"index": 0, "message": message | ({"tool_calls": made} if made else {}), "finish_reason": finish}
            return {"id": rid, "object": "chat.completion", "created": created, "model": served.name,
                    "choices": [choice], "usage": usage}
        return {"id": rid, "object": "text_completion", "created": created, "model": served.name,
                "choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": usage}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app
