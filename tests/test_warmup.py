"""The warm-up (warmup.py) runs every path of a generation once and changes no output token:
greedy output stays mlx-lm's, seeded sampling stays what the same seed gives without it,
with the GPU's paths (queued blocks, compiled blocks, padded reads) forced on this CPU."""

import json

import pytest
from tiny_models import MASK_ID, greedy_reference, load_tiny, make_tiny_target

from mlx_dflash import EngineOptions, create_random_draft, generate
from mlx_dflash import warmup as warmup_module
from mlx_dflash.cli import main
from mlx_dflash.generate import make_proposer
from mlx_dflash import policy as policy_module
from mlx_dflash.policy import candidate_sizes
from mlx_dflash.sampling import SamplingParams

GPU_PATHS = EngineOptions(queue_ahead=True, compile_blocks=True, pad_reads=True, device_trees=True)
MAX_TOKENS = 20


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "qwen3_5"])
def pair(request, tiny_dir):
    path = make_tiny_target(tiny_dir / f"warmup-{request.param}", request.param)
    model, tokenizer = load_tiny(path)
    tokenizer.eos_token_ids = set()
    config = json.loads((path / "config.json").read_text())
    draft = create_random_draft(config, num_layers=1, block_size=8, mask_token_id=MASK_ID)
    prompt = tokenizer.encode("def add(a, b):")
    return path, model, tokenizer, draft, prompt, greedy_reference(model, prompt, MAX_TOKENS)


@pytest.mark.parametrize("options", [GPU_PATHS, EngineOptions()], ids=["gpu-paths", "default"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_warmup_changes_no_greedy_token(pair, options, adaptive):
    _, model, tokenizer, draft, prompt, reference = pair
    result = generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, adaptive=adaptive, options=options,
                      warmup=True)
    assert result.tokens == reference


@pytest.mark.parametrize("adaptive", [False, True])
def test_blocks_of_one_warm_up_and_decode_the_greedy_tokens(pair, adaptive):
    _, model, tokenizer, draft, prompt, reference = pair
    result = generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, block_size=1, adaptive=adaptive,
                      options=GPU_PATHS, warmup=True)
    assert result.tokens == reference


def test_warmup_changes_no_seeded_sample(pair):
    _, model, tokenizer, draft, prompt, _ = pair
    sampling = SamplingParams(temp=0.8, seed=7)
    runs = [generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, sampling=sampling, options=GPU_PATHS,
                     warmup=warm).tokens for warm in (False, True, False)]
    assert runs[0] == runs[1] == runs[2]


def test_the_script_runs_every_size_the_policy_picks(pair):
    _, model, _, draft, _, _ = pair
    target, proposer = make_proposer(model, draft, GPU_PATHS)
    script = warmup_module.adaptive_script(8, tree_budgets=(16,))
    sizes = warmup_module.run_path(target, proposer, 16, 8, script=script)
    runs = [max(size if size <= 8 or target.verifies_trees else 8, 1) for size in script]  # (else chains)
    assert sizes[: len(script)] == runs and 0 in script  # (0: a plain step with a forecast)
    assert set(sizes) == set(candidate_sizes(8, (16,) if target.verifies_trees else ()))  # (a tree of 16 nodes: 17)
    assert warmup_module.run_path(target, proposer, 16, 1) == [1] * warmup_module.REPEATS


def test_long_context_only_where_block_attention_switches_kernels(pair, monkeypatch):
    _, model, _, draft, _, _ = pair
    target, proposer = make_proposer(model, draft)
    assert warmup_module.long_prompt_length(target, proposer) == 0  # (the CPU has one attention path)
    monkeypatch.setattr(warmup_module, "on_cuda", lambda: True)
    heads = min(target.args.num_attention_heads, draft.config.num_attention_heads)
    assert warmup_module.long_prompt_length(target, proposer) == warmup_module.MAX_HEADS_TIMES_KEYS // heads + 1


def test_trees_are_warmed_past_the_switch_too(pair, monkeypatch):
    """Where attention switches kernels past a long prompt, the warm-up runs there the policy's
    trees and fixed trees as well as blocks (a tree's verify has shapes of its own to build there)."""
    from mlx_dflash.policy import BlockPolicy

    _, model, _, draft, _, _ = pair
    long_runs, run_path = [], warmup_module.run_path

    def recorded(target, proposer, prompt_length, block_size, **kwargs):
        if prompt_length == 40:
            long_runs.append((kwargs.get("script"), kwargs.get("tree_budget")))
        return run_path(target, proposer, prompt_length, block_size, **kwargs)

    monkeypatch.setattr(warmup_module, "run_path", recorded)
    monkeypatch.setattr(warmup_module, "long_prompt_length", lambda target, proposer: 40)
    warmup_module.warm_up(model, draft, 8, GPU_PATHS, sampling=False, policy=BlockPolicy(8, tree_budgets=(16,)),
                          tree_budget=4)
    assert long_runs[0] == ([8, 8, 0, 1, 8, 17], None) and long_runs[1:] == [(None, 4)]


def test_cli_warmup_flag(pair, tmp_path, capsys):
    path, model, tokenizer, draft, prompt, reference = pair
    from mlx_dflash import save_draft

    draft_path = save_draft(draft, tmp_path / "draft")
    main(["generate", "--model", str(path), "--draft", str(draft_path), "--prompt", "def add(a, b):", "--no-chat",
          "--max-tokens", "6", "--warmup"])
    err = capsys.readouterr().err
    assert "warming up" in err


def test_a_warmup_teaches_the_policy_every_block_cost(pair):
    """With a policy, the warm-up times each size on a second pass: the first text then spends no
    full blocks on learning what they cost (it starts from what the policy knows)."""
    from mlx_dflash.policy import BlockPolicy

    _, model, tokenizer, draft, prompt, reference = pair
    policy = BlockPolicy(8, tree_budgets=policy_module.TREE_BUDGETS)
    warmup_module.warm_up(model, draft, 8, GPU_PATHS, policy=policy)
    trees = policy_module.TREE_BUDGETS if make_proposer(model, draft)[0].verifies_trees else ()
    assert set(policy.seconds) == set(candidate_sizes(8, trees))
    assert all(s > 0 for s in policy.seconds.values())
    policy.history = []
    result = generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, adaptive=policy, options=GPU_PATHS)
    assert result.tokens == reference
    assert policy.history and len(policy.history) == len(result.acceptance_lengths)


@pytest.mark.parametrize("pending", [1, 5, 16, 17, 300])
def test_padded_deferred_contexts_draft_as_unpadded_ones(pair, pending):
    """With padded reads, a run of plain steps' contexts is stored in a padded row count
    (``proposer.single_rows``): the draft then proposes exactly what it proposes unpadded."""
    import mlx.core as mx

    _, model, _, draft, prompt, _ = pair
    drafts = []
    for options in (GPU_PATHS, EngineOptions(pad_reads=False)):
        target, proposer = make_proposer(model, draft, options)
        proposer.start(target)
        ids = mx.array(prompt * (1 + pending // len(prompt)))[: len(prompt) + pending]
        _, features = target(ids[None], target.make_cache(), prompt=True)
        proposer.add_context(features[:, : len(prompt)])
        for i in range(len(prompt), ids.size):
            proposer.add_context(features[:, i : i + 1])  # (a plain step's: deferred)
        drafts.append(proposer.propose(ids[-1:], 7).tolist())
        assert [c.length for c in proposer.cache] == [ids.size] * len(proposer.cache)
    assert drafts[0] == drafts[1]


def test_the_warmup_stores_each_padded_row_count(pair, monkeypatch):
    _, model, _, draft, _, _ = pair
    target, proposer = make_proposer(model, draft, GPU_PATHS)
    stored = []
    original = draft.store_context
    monkeypatch.setattr(draft, "store_context", lambda context, *rest: (stored.append(context.shape[1]),
                                                                         original(context, *rest)))
    warmup_module.run_deferred_contexts(target, proposer, 8)
    assert stored[1:] == [16, 32, 64, 128, 256]  # (after the prompt's)


def test_fixed_trees_below_the_block_are_warmed_and_exact(pair, monkeypatch):
    """A fixed tree budget below the block is not a policy's size: the warm-up runs it as fixed trees."""
    _, model, tokenizer, draft, prompt, reference = pair
    budgets, run_path = [], warmup_module.run_path
    monkeypatch.setattr(warmup_module, "run_path", lambda *a, **k: budgets.append(k.get("tree_budget")) or run_path(*a, **k))
    result = generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, adaptive=False, trees=4,
                      options=GPU_PATHS, warmup=True)
    assert result.tokens == reference and 4 in budgets
