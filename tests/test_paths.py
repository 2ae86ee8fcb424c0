"""Every family through every decoding path and interface: the Python API (every family on
every path, greedy and sampling: fixed blocks, the adaptive policy and blocks of one token), the
CLI and the server (every family once, each path and mode in turn: what they add is passing the
options through, which no family changes).

Sampling runs with top-k 1: the whole sampling path (draft distributions, speculative
accept/reject, residual draws) with a one-hot target distribution, so its tokens must be
mlx-lm's greedy tokens. A sampled generation at a real temperature checks the cache
bookkeeping after one-token cycles (what crashed rotating and recurrent caches)."""

import json

import mlx.core as mx
import pytest
from fastapi.testclient import TestClient
from tiny_models import FAMILIES, MASK_ID, MORE_FAMILIES, greedy_reference, load_tiny, make_tiny_target

from mlx_dflash import create_random_draft, generate, save_draft
from mlx_dflash.cli import main
from mlx_dflash.engine import decode_cycles
from mlx_dflash.generate import make_proposer
from mlx_dflash.rollback import DeviceKVCache
from mlx_dflash.sampling import SamplingParams
from mlx_dflash.server import Served, create_app

MAX_TOKENS = 24
PROMPT = "def fib(n):"
PATHS = {"fixed": {"adaptive": False}, "adaptive": {"adaptive": True}, "block1": {"adaptive": False, "block_size": 1}}
CLI_FLAGS = {"fixed": ["--no-adaptive"], "adaptive": ["--adaptive"], "block1": ["--no-adaptive", "--block-size", "1"]}
MODES = ["greedy", "sampling"]
# (family, path, mode) for the CLI and the server: each family once, every path and mode in turn
INTERFACE_RUNS = [(name, list(PATHS)[i % len(PATHS)], MODES[i // len(PATHS) % len(MODES)])
                  for i, name in enumerate([*FAMILIES, *MORE_FAMILIES])]


@pytest.fixture(scope="module", params=[*FAMILIES, *MORE_FAMILIES])
def family(request, tiny_dir):
    """(name, model folder, draft folder, model, tokenizer, prompt ids, greedy reference up to EOS)."""
    name = request.param
    path = make_tiny_target(tiny_dir / f"paths-{name}", name)
    model, tokenizer = load_tiny(path)
    config = json.loads((path / "config.json").read_text())
    draft = create_random_draft(config, num_layers=1, block_size=8, mask_token_id=MASK_ID)
    draft_path = save_draft(draft, tiny_dir / f"paths-{name}-draft")
    prompt = tokenizer.encode(PROMPT)
    reference = greedy_reference(model, prompt, MAX_TOKENS)
    eos = set(tokenizer.eos_token_ids)
    reference = reference[: next((i for i, t in enumerate(reference) if t in eos), len(reference))]
    return name, str(path), str(draft_path), model, tokenizer, draft, prompt, reference


def _sampling(mode: str):
    return SamplingParams(temp=1.0, top_k=1) if mode == "sampling" else None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", list(PATHS))
def test_api_equals_greedy(family, mode, path):
    _, _, _, model, tokenizer, draft, prompt, reference = family
    result = generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, sampling=_sampling(mode), **PATHS[path])
    assert result.tokens == reference
    if path == "block1":
        assert set(result.acceptance_lengths) == {1}


@pytest.mark.parametrize("family, path, mode", INTERFACE_RUNS, indirect=["family"])
def test_cli_prints_the_api_text(family, mode, path, capsys):
    _, model_dir, draft_dir, model, tokenizer, draft, prompt, reference = family
    expected = generate(model, tokenizer, PROMPT, draft, max_tokens=MAX_TOKENS).text
    flags = ["--temp", "1", "--top-k", "1"] if mode == "sampling" else []
    code = main(["generate", "--model", model_dir, "--draft", draft_dir, "--prompt", PROMPT, "--no-chat",
                 "--max-tokens", str(MAX_TOKENS), *flags, *CLI_FLAGS[path]])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith(expected + "\n") and "mean acceptance length" in out


@pytest.mark.parametrize("family, path, mode", INTERFACE_RUNS, indirect=["family"])
def test_server_returns_the_api_text(family, mode, path):
    _, _, _, model, tokenizer, draft, prompt, reference = family
    served = Served(model, tokenizer, draft, "tiny", 2048, 512, adaptive=PATHS[path]["adaptive"],
                    block_size=PATHS[path].get("block_size"))
    messages = [{"role": "user", "content": PROMPT}]
    expected = generate(model, tokenizer, messages, draft, max_tokens=MAX_TOKENS)
    body = {"messages": messages, "max_tokens": MAX_TOKENS}
    if mode == "sampling":
        body.update(temperature=1.0, top_k=1)
    with TestClient(create_app(served)) as client:
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected.text
        assert reply.json()["usage"]["completion_tokens"] == len(expected.tokens)


@pytest.mark.parametrize("path", list(PATHS))
def test_sampled_one_token_cycles_keep_caches_exact(family, path):
    """At a real temperature: no crash, and every attention cache holds exactly the committed
    tokens after each cycle (one-token cycles once left a device count behind: rotating and
    recurrent caches failed, plain ones stopped bounding their reads)."""
    _, _, _, model, tokenizer, draft, prompt, _ = family
    target, proposer = make_proposer(model, draft)
    caches = []
    make_cache = target.make_cache
    target.make_cache = lambda: caches.append(make_cache()) or caches[-1]  # (this instance only)
    block = PATHS[path].get("block_size", draft.block_size)
    cycles = decode_cycles(target, proposer, mx.array(prompt), MAX_TOKENS, block, SamplingParams(temp=0.9, seed=3))
    emitted = 0
    for cycle in cycles:
        emitted += len(cycle.tokens)
        in_cache = len(prompt) + emitted - 1  # (the latest token is the next block's first, not cached yet)
        for cache in caches[0]:  # (the next cycle is launched before this one is yielded)
            if isinstance(cache, DeviceKVCache):
                assert isinstance(cache.offset, int) and cache.offset == cache.bound
            if hasattr(cache, "offset"):
                assert in_cache <= cache.offset <= in_cache + block
    assert emitted == MAX_TOKENS
