"""Tree verification (DDTree, ``tree.py``): the tree is the budget's most likely prefixes, its
mask is each node's ancestors, and a tree-verified generation is the target's own, on every
family with attention caches, greedy and sampled, through the CPU's and the GPU's cache paths."""

import itertools
import json

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import FAMILIES, MASK_ID, MORE_FAMILIES, greedy_reference, load_tiny, make_tiny_target

from mlx_dflash import create_random_draft
from mlx_dflash.engine import decode_cycles
from mlx_dflash.generate import make_proposer
from mlx_dflash.options import EngineOptions
from mlx_dflash.replay import ReplayProposer
from mlx_dflash.sampling import SamplingParams
from mlx_dflash.target import Target
from mlx_dflash.tree import (DEVICE_DEVIATIONS, DraftTree, build_tree, candidate_table, device_tree,
                              top_candidates, tree_mask)
from mlx_dflash.warmup import ScriptedSizes

TREE_FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gpt_oss"]
MAX_TOKENS = 40


def brute_force_top(logprobs: np.ndarray, budget: int) -> set[tuple[int, ...]]:
    """The ``budget`` best prefixes (as rank tuples) among all of them."""
    depth, k = logprobs.shape
    scored = []
    for length in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=length):
            scored.append((sum(logprobs[d, r] for d, r in enumerate(ranks)), ranks))
    scored.sort(reverse=True)
    return {ranks for _, ranks in scored[:budget]}


def tree_prefix(tree: DraftTree, ids: np.ndarray, node: int) -> tuple[int, ...]:
    """A node's prefix as a rank tuple (ids[d] lists depth d + 1's candidates)."""
    if node == 0:
        return ()
    rank = list(ids[tree.depths[node] - 1]).index(tree.tokens[node])
    return tree_prefix(tree, ids, tree.parents[node]) + (rank,)


def tree_prefixes(tree: DraftTree, ids: np.ndarray) -> set[tuple[int, ...]]:
    return {tree_prefix(tree, ids, node) for node in range(1, tree.size)}


@pytest.mark.parametrize("depth,k,budget", [(1, 4, 3), (3, 3, 5), (4, 2, 9), (3, 4, 20), (2, 5, 25), (5, 3, 1)])
def test_tree_is_the_best_prefixes(depth, k, budget):
    rng = np.random.default_rng(depth * 100 + k * 10 + budget)
    logprobs = -np.sort(rng.exponential(2.0, (depth, k)), axis=1)  # best first, no ties
    ids = np.stack([rng.permutation(50)[:k] for _ in range(depth)])
    tree = build_tree(7, logprobs, ids, budget)
    assert tree.size == 1 + min(budget, sum(k**d for d in range(1, depth + 1)))
    assert tree_prefixes(tree, ids) == brute_force_top(logprobs, budget)
    assert all(tree.parents[n] < n and tree.depths[n] == tree.depths[tree.parents[n]] + 1 for n in range(1, tree.size))
    assert tree.tokens[0] == 7
    chain = [n for n in range(tree.size) if all(r == 0 for r in tree_prefix(tree, ids, n))]  # (the draft's own)
    assert chain == list(range(len(chain)))  # nodes 0, 1, 2, ...: walking it moves nothing


def as_host_tree(tree) -> DraftTree:
    return DraftTree(np.array(tree.tokens).tolist(), [-1] + np.array(tree.parents)[1:].tolist(),
                     np.array(tree.depths).tolist())


@pytest.mark.parametrize("depth,budget,within", [(3, 5, True), (4, 20, True), (7, 12, True), (7, 40, True),
                                                 (15, 64, False)])
def test_device_tree_is_the_best_prefixes_it_may_pick(depth, budget, within):
    """On the device: the best prefixes with at most two ranks off the argmax, each below 4,
    a tree whose ``ancestors`` and ``parents`` agree; where the host's best-first tree stays
    within those prefixes (a confident draft), the same tree."""
    rng = np.random.default_rng(depth * 10 + budget)
    vocab = 30
    logits = mx.array(rng.normal(0, 3, (depth, vocab)).astype(np.float32))
    tree = device_tree(mx.array([7]), logits, budget)
    logprobs, ids = (np.array(x) for x in top_candidates(logits, 4))
    host = as_host_tree(tree)
    assert host.tokens[0] == 7 and host.size == budget + 1
    assert (np.array(tree.ancestors) == host.ancestors()).all()
    assert all(host.depths[n] == host.depths[host.parents[n]] + 1 for n in range(1, host.size))
    may = [tuple(ranks.get(d, 0) for d in range(length)) for length in range(1, depth + 1)
           for count in range(DEVICE_DEVIATIONS + 1) for where in itertools.combinations(range(length), count)
           for ranks in (dict(zip(where, r)) for r in itertools.product(range(1, 4), repeat=count))]
    assert len(may) == candidate_table(depth, 4, DEVICE_DEVIATIONS)[0].shape[0]
    score = {r: sum(logprobs[d, x] for d, x in enumerate(r)) for r in may}
    expected = set(sorted(may, key=lambda r: -score[r])[:budget])
    assert tree_prefixes(host, ids) == expected
    confident = logits * 4
    tree = as_host_tree(device_tree(mx.array([7]), confident, budget))
    logprobs, ids = (np.array(x) for x in top_candidates(confident, budget))
    reference = build_tree(7, logprobs, ids, budget)
    assert within == all(sum(r > 0 for r in prefix) <= DEVICE_DEVIATIONS and max(prefix) < 4
                         for prefix in tree_prefixes(reference, ids))
    assert (tree_prefixes(tree, ids) == tree_prefixes(reference, ids)) == within


def test_device_walk_is_the_host_walk():
    rng = np.random.default_rng(5)
    for trial in range(40):
        tree = device_tree(mx.array([3]), mx.array(rng.normal(0, 2, (7, 12)).astype(np.float32)), 1 + trial % 30)
        host = as_host_tree(tree)
        children = host.children()
        choices = [int(rng.choice(list(children[n]))) if children[n] and rng.random() < 0.8 else int(rng.integers(12))
                   for n in range(host.size)]
        path, bonus = host.walk(choices)
        order, accepted = tree.walk(mx.array(choices))
        a = accepted.item()
        assert a == len(path) - 1 and np.array(order)[: a + 1].tolist() == path
        assert choices[path[-1]] == bonus and sorted(np.array(order).tolist()) == list(range(host.size))


def test_top_candidates_are_sorted_log_probabilities():
    logits = mx.random.normal((3, 40), key=mx.random.key(3))
    values, ids = top_candidates(logits, 5)
    full = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    expected = np.argsort(-full, axis=1)[:, :5]
    assert (np.array(ids) == expected).all()
    np.testing.assert_allclose(np.array(values), np.take_along_axis(full, expected, axis=1), rtol=1e-6)


def test_walk_follows_the_targets_choices():
    #      0 -> 1 (tok 5) -> 3 (tok 8)
    #        -> 2 (tok 6) -> 4 (tok 9)
    tree = DraftTree(tokens=[1, 5, 6, 8, 9], parents=[-1, 0, 0, 1, 2], depths=[0, 1, 1, 2, 2])
    assert tree.walk([6, 0, 9, 0, 4]) == ([0, 2, 4], 4)
    assert tree.walk([5, 7, 0, 0, 0]) == ([0, 1], 7)
    assert tree.walk([3, 0, 0, 0, 0]) == ([0], 3)


def test_mask_shows_each_node_its_ancestors_and_the_past():
    tree = DraftTree(tokens=[1, 5, 6, 8, 9], parents=[-1, 0, 0, 1, 2], depths=[0, 1, 1, 2, 2])
    past = 3
    sequential = mx.arange(past + 5)[None] <= (past + mx.arange(5))[:, None]
    mask = np.array(tree_mask(tree, sequential, past))
    assert mask[:, :past].all()
    expected = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], bool)
    assert (mask[:, past:] == expected).all()
    # a window of 2: node 3 (depth 2) sees its parent, itself, and past positions > start + 2 - 2
    windowed = np.array(tree_mask(tree, sequential & (mx.arange(past + 5)[None] > (past + mx.arange(5))[:, None] - 2),
                                  past, window=2))
    assert windowed[3].tolist() == [False, False, False, False, True, False, True, False]


class PlantedProposer(ReplayProposer):
    """Draft distributions with the target's true next token at a planted rank per slot
    (0: the chain would take it; 1 or 2: only a tree finds it; None: nowhere near)."""

    RANKS = [0, 1, 0, 2, None, 0, 1]

    def draft_logits(self, first_token: mx.array, num_tokens: int) -> mx.array:
        rng = np.random.default_rng(self.cycle)
        logits = rng.random((num_tokens, self.vocab_size)).astype(np.float32)
        reference = np.array(self.tokens)
        position = int(self.position)
        for slot in range(num_tokens):
            truth = int(reference[min(position + 1 + slot, reference.size - 1)])
            decoys = [t for t in rng.permutation(self.vocab_size)[:4].tolist() if t != truth]
            rank = self.RANKS[(self.cycle + slot) % len(self.RANKS)]
            for token, r in zip(decoys, [r for r in range(4) if r != rank]):
                logits[slot, token] = 10.0 - r
            if rank is not None:
                logits[slot, truth] = 10.0 - rank
        self.cycle += 1
        return mx.array(logits)

    def candidate_logits(self, first_token: mx.array, num_tokens: int) -> tuple[mx.array, None]:
        return self.draft_logits(first_token, num_tokens), None

    def propose(self, first_token: mx.array, num_tokens: int) -> mx.array:
        return mx.argmax(self.draft_logits(first_token, num_tokens), axis=-1)


@pytest.fixture(scope="module", params=TREE_FAMILIES)
def planted(request, tiny_dir):
    name = request.param
    assert name in FAMILIES or name in MORE_FAMILIES
    path = make_tiny_target(tiny_dir / f"tree-{name}", name)
    model, tokenizer = load_tiny(path)
    prompt = tokenizer.encode("def fib(n):")
    reference = greedy_reference(model, prompt, MAX_TOKENS)
    proposer = PlantedProposer(prompt + reference, 8, [None], model.args.vocab_size)
    return name, model, prompt, reference, proposer


def _generate(model, proposer, prompt, options=EngineOptions(), sampling=None, budget=12, block_size=8):
    target = Target(model, proposer.layer_ids, options)
    moved = []  # trees walked on the device (``Target.move_path``)
    move_path = target.move_path
    target.move_path = lambda *args: moved.append(move_path(*args))
    cycles = list(decode_cycles(target, proposer, mx.array(prompt), MAX_TOKENS, block_size, sampling,
                                tree_budget=budget))
    target.device_trees = len(moved)
    return [t for c in cycles for t in c.tokens], [c.acceptance_length for c in cycles[1:]], target


GPU_PATHS = EngineOptions(queue_ahead=True, pad_reads=True, compile_blocks=True, rowwise_products=True,
                          device_trees=True)


@pytest.mark.parametrize("options", [EngineOptions(), GPU_PATHS], ids=["cpu-paths", "gpu-paths"])
@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_tree_generation_is_the_targets(planted, mode, options):
    name, model, prompt, reference, proposer = planted
    sampling = SamplingParams(temp=1.0, top_k=1) if mode == "sampling" else None
    tokens, acceptance, target = _generate(model, proposer, prompt, options, sampling)
    assert tokens == reference
    compiled_trees = any(key[-1] for key in target.recorder.block_forwards)
    assert compiled_trees == (options is GPU_PATHS and target.rolls_back_on_device)  # (rotating caches: eager)
    # greedy trees queued ahead as blocks are: built, walked and rolled back on the device
    assert (target.device_trees > 0) == (compiled_trees and sampling is None)
    chain_tokens, chain_acceptance, _ = _generate(model, proposer, prompt, options, sampling, budget=None)
    assert chain_tokens == reference
    # the planted ranks 1 and 2 are found by the tree only: fewer, longer cycles
    assert np.mean(acceptance) > np.mean(chain_acceptance) + 0.5, (acceptance, chain_acceptance)


@pytest.mark.parametrize("options", [EngineOptions(), GPU_PATHS], ids=["cpu-paths", "gpu-paths"])
def test_a_budget_below_the_block_verifies_trees_of_that_many_nodes(planted, options):
    """Fixed blocks' trees of fewer nodes than the block has drafts (a CPU's verify costs its
    rows): each cycle verifies 1 + B tokens as a tree, on the device where blocks queue ahead,
    and commits more than a chain of as many tokens (the planted ranks 1 and 2)."""
    _, model, prompt, reference, proposer = planted
    for budget in (1, 4):
        tokens, acceptance, target = _generate(model, proposer, prompt, options, budget=budget)
        assert tokens == reference
        assert (target.device_trees > 0) == (options is GPU_PATHS and target.rolls_back_on_device)
        assert max(acceptance) <= budget + 1
    chain_tokens, chain_acceptance, _ = _generate(model, proposer, prompt, options, budget=None, block_size=5)
    assert chain_tokens == reference
    assert np.mean(acceptance) > np.mean(chain_acceptance), (acceptance, chain_acceptance)


def test_a_budget_past_the_device_candidates_builds_the_tree_on_the_host(planted):
    """A block of 4 leaves a device-built tree 57 prefixes to pick from: a larger budget
    takes the host's tree (every prefix), also where cycles are queued ahead."""
    _, model, prompt, reference, proposer = planted
    assert candidate_table(3, 4, DEVICE_DEVIATIONS)[0].shape[0] == 57
    for budget, on_device in [(57, True), (60, False)]:
        tokens, _, target = _generate(model, proposer, prompt, GPU_PATHS, budget=budget, block_size=4)
        assert tokens == reference
        assert (target.device_trees > 0) == (on_device and target.rolls_back_on_device)


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_real_draft_with_a_tree(tiny_dir, family):
    """A (random) DFlash draft through the tree path; hybrid targets keep chains."""
    path = make_tiny_target(tiny_dir / f"tree-draft-{family}", family)
    model, tokenizer = load_tiny(path)
    draft = create_random_draft(json.loads((path / "config.json").read_text()), num_layers=1, block_size=8,
                                mask_token_id=MASK_ID)
    prompt = tokenizer.encode("def fib(n):")
    target, proposer = make_proposer(model, draft)
    cycles = list(decode_cycles(target, proposer, mx.array(prompt), MAX_TOKENS, 8, tree_budget=24))
    assert [t for c in cycles for t in c.tokens] == greedy_reference(model, prompt, MAX_TOKENS)
    assert max(c.block_size for c in cycles[1:]) == (8 if family == "qwen3_5" else 25)  # (a tree: 1 + 24 nodes)


@pytest.mark.parametrize("options", [EngineOptions(), GPU_PATHS], ids=["cpu-paths", "gpu-paths"])
def test_trees_among_queued_blocks_and_plain_steps(planted, options):
    """What an adaptive policy may pick in turn: trees between full blocks queued ahead (GPUs),
    short blocks and plain steps, with and without a forecast."""
    _, model, prompt, reference, proposer = planted
    script = [13, 8, 8, 13, 1, 0, 1, 13, 4, 13, 8, 8, 2, 13, 13] * 3
    target = Target(model, proposer.layer_ids, options)
    cycles = list(decode_cycles(target, proposer, mx.array(prompt), MAX_TOKENS, 8,
                                policy=ScriptedSizes(script, block_size=8)))
    assert [t for c in cycles for t in c.tokens] == reference
    assert 13 in [c.block_size for c in cycles]
