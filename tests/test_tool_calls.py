"""Tool calling in the server: replies split into content and OpenAI tool calls (``tool_calls.py``),
tools put in the chat template, earlier calls and tool replies taken back as messages."""

import json
import random
import threading
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from mlx_lm.tool_parsers import json_tools
from openai import OpenAI
from tiny_models import MASK_ID, free_port, load_tiny, make_tiny_target, wait_until_healthy

import mlx_dflash.server as server_module
from mlx_dflash import create_random_draft
from mlx_dflash.generate import StreamResponse
from mlx_dflash.server import Served, create_app
from mlx_dflash.tool_calls import ToolCallText

JSON_TOOLS = SimpleNamespace(tool_call_start=json_tools.tool_call_start, tool_call_end=json_tools.tool_call_end,
                             tool_parser=json_tools.parse_tool_call)
REPLY = 'Let me look. <tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def split(text: str, tokenizer=JSON_TOOLS, pieces: int = 1, seed: int = 0):
    """(content, calls) of ``text`` fed in ``pieces`` random pieces."""
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), pieces - 1)) if pieces > 1 else []
    calls, content, made = ToolCallText(tokenizer, TOOLS), "", []
    for start, end in zip([0] + cuts, cuts + [len(text)]):
        more, new = calls.add(text[start:end])
        content, made = content + more, made + new
    more, new = calls.finish()
    return content + more, made + new


@pytest.mark.parametrize("pieces", [1, 2, 7, 40, len(REPLY)])
def test_a_reply_splits_into_content_and_calls_however_it_streams(pieces):
    for seed in range(5):
        content, calls = split(REPLY + " Done.", pieces=pieces, seed=seed)
        assert content == "Let me look.  Done."
        assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [("function", "weather", {"city": "Paris"})]


def test_held_back_text_unterminated_and_malformed_calls():
    calls = ToolCallText(JSON_TOOLS, TOOLS)
    assert calls.add("a <tool") == ("a ", [])  # (may begin the marker: held back)
    assert calls.add("box") == ("<toolbox", [])  # (did not)
    content, made = split('x <tool_call>{"name": "weather", "arguments": {}}')  # (cut by max_tokens)
    assert content == "x " and made[0]["function"] == {"name": "weather", "arguments": "{}"}
    content, made = split("x <tool_call>{not json}</tool_call> y")
    assert content == "x <tool_call>{not json}</tool_call> y" and made == []
    two, made = split(REPLY + REPLY)
    assert two == "Let me look. Let me look. " and len(made) == 2 and made[0]["id"] != made[1]["id"]
    to_the_end = SimpleNamespace(tool_call_start="[TOOL_CALLS]", tool_call_end="", tool_parser=json_tools.parse_tool_call)
    content, made = split('ok [TOOL_CALLS]{"name": "weather", "arguments": {"city": "Oslo"}}', to_the_end, pieces=9)
    assert content == "ok " and json.loads(made[0]["function"]["arguments"]) == {"city": "Oslo"}


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for call in m.tool_calls %}"
    "{% set tool_call = call.function %}<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tool_server(tiny_dir):
    path = make_tiny_target(tiny_dir / "tools-qwen3", "qwen3")
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    model, tokenizer = load_tiny(path)
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"  # (mlx-lm's json_tools)
    draft = create_random_draft(json.loads((path / "config.json").read_text()), num_layers=1, mask_token_id=MASK_ID)
    prompts = []

    def scripted(model, tokenizer, prompt, draft, **kwargs):
        """The reply of a model that calls a tool (random weights would not), in uneven pieces."""
        prompts.append(tokenizer.decode(prompt))
        pieces = [REPLY[:9], REPLY[9:20], REPLY[20:51], REPLY[51:]]
        for i, piece in enumerate(pieces):
            yield StreamResponse(text=piece, tokens=[1], acceptance_length=1, cycle=i, prompt_tokens=len(prompt),
                                 prefill_seconds=0.0, generation_tokens=i + 1, decode_tokens_per_sec=1.0,
                                 finish_reason="stop" if i == len(pieces) - 1 else None)

    port = free_port()
    app = create_app(Served(model, tokenizer, draft, "tiny", 2048, 256, decode_concurrency=1))
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server_module, "stream_generate", scripted)
        thread = threading.Thread(target=uv.run, daemon=True)
        thread.start()
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, 10)
        yield base, prompts
        uv.should_exit = True
        thread.join(timeout=10)


def test_the_official_client_gets_tool_calls(tool_server):
    base, prompts = tool_server
    client = OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look. "
    call = choice.message.tool_calls[0]
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert "Tools: weather" in prompts[-1]  # (the template listed the tools)
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            calls[c.index] = (c.function.name, json.loads(c.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    assert (content, calls, finish) == ("Let me look. ", {0: ("weather", {"city": "Paris"})}, "tool_calls")
    # the agent's next turn: the call it made and the tool's answer go back into the template
    turn = messages + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "18 C, clear"}]
    client.chat.completions.create(model="tiny", messages=turn, tools=TOOLS)
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>' in prompts[-1]
    assert "18 C, clear" in prompts[-1]
    reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none")
    assert reply.choices[0].finish_reason == "stop" and "Tools:" not in prompts[-1]  # (no tools: plain text)


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                       "arguments": "{x"}}]}]},
     "messages"),
])
def test_bad_tool_requests_get_a_400(tool_server, body, param):
    r = httpx.post(tool_server[0] + "/v1/chat/completions",
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
