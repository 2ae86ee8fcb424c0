"""Lossless sampling: the emitted distribution is the target's. The accept/reject rule is checked
exactly, its randomness enumerated; whole generations are checked statistically (chi-square)."""

import json
import math
import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from tiny_models import greedy_reference, load_tiny, make_tiny_target

import mlx_dflash.sampling as sampling_module
from mlx_dflash import create_random_draft, generate
from mlx_dflash.batch import BatchDecoder
from mlx_dflash.engine import decode_cycles
from mlx_dflash.options import EngineOptions
from mlx_dflash.proposer import DFlashProposer
from mlx_dflash.sampling import SamplingParams
from mlx_dflash.target import Target

VOCAB = 16  # a tiny vocabulary makes the exact distributions cheap to compute
SAMPLES = 400  # a wrong acceptance rule scores chi-square in the thousands against a bound of ~35
Z_999 = 3.090  # standard normal quantile for significance 1e-3


def chi_square_bound(dof: int) -> float:
    """The 1 - 1e-3 quantile of chi-square (Wilson-Hilferty approximation)."""
    return dof * (1 - 2 / (9 * dof) + Z_999 * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> tuple[float, int]:
    expected = expected_probs * counts.sum()
    big = expected >= 5  # merge sparse cells so the approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum() - 1)


@pytest.fixture(scope="module")
def setup(tiny_dir):
    path = make_tiny_target(tiny_dir / "sampling-qwen3", "qwen3", vocab_size=VOCAB, num_hidden_layers=2)
    model, tokenizer = load_tiny(path)
    config = json.loads((path / "config.json").read_text())
    draft = create_random_draft(config, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, seed=5)
    return model, tokenizer, draft, [3, 7, 1]


def exact_marginals(model, prompt, params):
    """P(t2) and P(t3) under the target's own sampling, by enumerating t1 and t2."""
    def probs(prefixes):
        logits = model(mx.array(prefixes))[:, -1]
        logits = mx.concatenate([params.process_row(logits[i : i + 1], mx.array(prefix))
                                 for i, prefix in enumerate(prefixes)])  # processors see each prefix
        return np.array(params.probabilities(logits))

    p1 = probs([prompt])[0]
    p2_given = probs([prompt + [a] for a in range(VOCAB)])  # [t1, t2]
    p3_given = probs([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).reshape(VOCAB, VOCAB, VOCAB)
    p2 = p1 @ p2_given
    p3 = np.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    return p2, p3


def sampled_marginals(model, draft, prompt, params, options=EngineOptions(), tree_budget=None):
    target = Target(model, draft.config.target_layer_ids, options)
    proposer = DFlashProposer(draft)
    random.seed(1234)  # (the generations' own streams start from Python's random)
    counts = np.zeros((2, VOCAB))
    for _ in range(SAMPLES):
        cycles = decode_cycles(target, proposer, mx.array(prompt), 3, 4, params, tree_budget=tree_budget)  # (t1..t3)
        tokens = [t for cycle in cycles for t in cycle.tokens]
        counts[0, tokens[1]] += 1  # t2: first drafted slot (or its residual resample)
        counts[1, tokens[2]] += 1  # t3: second drafted slot (or bonus)
    return counts


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temp=1.0), SamplingParams(temp=0.7, top_k=10, top_p=0.95),
     SamplingParams(temp=1.0, logits_processors=make_logits_processors(repetition_penalty=2.0))],
    ids=["temp1", "temp0.7-topk-topp", "temp1-repetition-penalty"],
)
def test_emitted_distribution_is_the_targets(setup, params):
    model, _, draft, prompt = setup
    p2, p3 = exact_marginals(model, prompt, params)
    counts = sampled_marginals(model, draft, prompt, params)
    for observed, expected in ((counts[0], p2), (counts[1], p3)):
        stat, dof = chi_square(observed, expected)
        assert stat < chi_square_bound(dof), (stat, dof)


def test_emitted_distribution_with_compiled_blocks(setup):
    """What GPUs run for sampling: blocks through the compiled forward, counts read on the host."""
    options = EngineOptions(compile_blocks=True, rowwise_products=True)
    model, _, draft, prompt = setup
    params = SamplingParams(temp=1.0)
    p2, p3 = exact_marginals(model, prompt, params)
    counts = sampled_marginals(model, draft, prompt, params, options)
    assert Target(model, draft.config.target_layer_ids).recorder.block_forwards  # (it ran)
    for observed, expected in ((counts[0], p2), (counts[1], p3)):
        stat, dof = chi_square(observed, expected)
        assert stat < chi_square_bound(dof), (stat, dof)


def dflash2_draft(model):
    """A DFlash2 draft whose selector re-ranks the head's top 4 (a non-zero successor codebook)."""
    from mlx_dflash.draft_config import DFlash2Config

    v2 = create_random_draft(dict(vars(model.args)), num_layers=1, block_size=4, mask_token_id=VOCAB - 1, seed=5,
                             dflash2=DFlash2Config(conv_group_size=16, selector_rank=8, selector_top_k=4))
    v2.candidate_selector.successor_codebook.weight = mx.random.normal((VOCAB, 8), key=mx.random.key(1))
    return v2


def test_emitted_distribution_with_a_dflash2_draft(setup):
    """A DFlash2 draft samples each slot from its selector's sparse q over the head's top-k
    candidates; rejection sampling against it keeps the target's distribution."""
    model, _, _, prompt = setup
    v2 = dflash2_draft(model)
    params = SamplingParams(temp=1.0)
    p2, p3 = exact_marginals(model, prompt, params)
    counts = sampled_marginals(model, v2, prompt, params)
    for observed, expected in ((counts[0], p2), (counts[1], p3)):
        stat, dof = chi_square(observed, expected)
        assert stat < chi_square_bound(dof), (stat, dof)


@pytest.mark.parametrize("params", [SamplingParams(temp=1.0), SamplingParams(temp=0.7, top_k=10, top_p=0.95)],
                         ids=["temp1", "temp0.7-topk-topp"])
def test_emitted_distribution_with_trees(setup, params):
    """A tree keeps the target's own sample at each node it walks: no rejection sampling."""
    model, _, draft, prompt = setup
    p2, p3 = exact_marginals(model, prompt, params)
    counts = sampled_marginals(model, draft, prompt, params, tree_budget=8)
    for observed, expected in ((counts[0], p2), (counts[1], p3)):
        stat, dof = chi_square(observed, expected)
        assert stat < chi_square_bound(dof), (stat, dof)


@pytest.mark.parametrize("params, version", [(SamplingParams(temp=1.0), "v1"),
                                             (SamplingParams(temp=0.7, top_k=10, top_p=0.95), "v1"),
                                             (SamplingParams(temp=1.0), "v2")],
                         ids=["temp1", "temp0.7-topk-topp", "temp1-dflash2"])
def test_emitted_distribution_in_a_batch(setup, params, version):
    """Sampled rows of a batch (``BatchDecoder``), beside a greedy row: each row's tokens are
    distributed as the target's own sampling (a DFlash2 draft's rows drawn through its
    selector); the greedy row's are its greedy ones."""
    model, _, draft, prompt = setup
    draft = dflash2_draft(model) if version == "v2" else draft
    p2, p3 = exact_marginals(model, prompt, params)
    decoder = BatchDecoder(model, draft, 4)
    random.seed(1234)  # (the generations' own streams start from Python's random)
    counts, greedy_outputs = np.zeros((2, VOCAB)), set()
    for _ in range(SAMPLES // 8):
        rows = [decoder.add(mx.array(prompt), 3, params) for _ in range(8)] + [decoder.add(mx.array(prompt), 3)]
        outputs = {row.id: list(row.tokens) for row in rows}
        while decoder.rows:
            for row, tokens in decoder.step().items():
                outputs[row] += tokens
        for row in rows[:-1]:
            counts[0, outputs[row.id][1]] += 1
            counts[1, outputs[row.id][2]] += 1
        greedy_outputs.add(tuple(outputs[rows[-1].id]))
    for observed, expected in ((counts[0], p2), (counts[1], p3)):
        stat, dof = chi_square(observed, expected)
        assert stat < chi_square_bound(dof), (stat, dof)
    assert greedy_outputs == {tuple(greedy_reference(model, prompt, 3))}


def test_the_check_catches_a_wrong_tree_walk(setup, monkeypatch):
    """Keeping the draft's first child at every node (a biased walk) fails the same check."""
    from mlx_dflash.tree import DraftTree

    def biased(tree, choices):  # (the walk under test, deliberately wrong)
        path = [0]
        while any(tree.parents[node] == path[-1] for node in range(tree.size)):
            path.append(next(node for node in range(tree.size) if tree.parents[node] == path[-1]))
        return path, choices[path[-1]]

    monkeypatch.setattr(DraftTree, "walk", biased)
    model, _, draft, prompt = setup
    params = SamplingParams(temp=1.0)
    p2, p3 = exact_marginals(model, prompt, params)
    counts = sampled_marginals(model, draft, prompt, params, tree_budget=8)
    stats = [chi_square(counts[0], p2), chi_square(counts[1], p3)]
    assert any(stat > chi_square_bound(dof) for stat, dof in stats), stats


def test_the_check_catches_a_wrong_acceptance_rule(setup, monkeypatch):
    """Accepting with min(1, q/p) instead of min(1, p/q) must fail the same test."""
    model, _, draft, prompt = setup

    def inverted(p, q, drafted, key):  # the rule under test, deliberately wrong
        n = drafted.shape[0]
        p_d, q_d = p[mx.arange(n), drafted], q[mx.arange(n), drafted]
        uniform_key, bonus_key = mx.random.split(key)
        keep = mx.random.uniform(shape=(n,), key=uniform_key) * p_d < q_d
        a = mx.cumprod(keep.astype(mx.int32)).sum(keepdims=True)
        bonus = mx.random.categorical(mx.log(p), key=bonus_key).astype(mx.uint32)
        return mx.where(mx.arange(n + 1) == a, bonus, mx.concatenate([drafted, bonus[:1]])), a

    monkeypatch.setattr(sampling_module, "speculative_accept", inverted)
    params = SamplingParams(temp=1.0)
    p2, p3 = exact_marginals(model, prompt, params)
    counts = sampled_marginals(model, draft, prompt, params)
    stats = [chi_square(counts[0], p2), chi_square(counts[1], p3)]
    assert any(stat > chi_square_bound(dof) for stat, dof in stats), stats


def emitted_by_enumeration(p: np.ndarray, q: np.ndarray, rule, monkeypatch, grid: int = 2000) -> np.ndarray:
    """The exact distribution of the first emitted token of a one-draft block under ``rule``
    (``speculative_accept``'s signature): the drafted token enumerated over the vocabulary with
    its probability q, the uniform draw over a grid of ``grid`` points, and the residual draw
    replaced by the distribution it draws from."""
    drawn = []
    monkeypatch.setattr(sampling_module, "sample", lambda probs, key: drawn.append(np.array(probs)) or mx.zeros(
        probs.shape[:1], mx.uint32))
    u = mx.array((np.arange(grid) + 0.5) / grid, dtype=mx.float32)
    emitted = np.zeros(p.shape[1])
    for d in range(p.shape[1]):
        accepted = 0
        for i in range(grid):
            drawn.clear()
            _, a = rule(mx.array(p), mx.array(q), mx.array([d], dtype=mx.uint32), mx.random.key(0), u[i : i + 1])
            accepted += int(a.item())
        keep = accepted / grid
        emitted[d] += q[0, d] * keep
        emitted += q[0, d] * (1 - keep) * drawn[-1][0]  # row 0 of the bonus draw: the residual
    return emitted


def test_accept_rule_is_exact_by_enumeration(monkeypatch):
    """min(1, p/q) acceptance with the normalized residual max(0, p - q) emits exactly p, for
    any q (within the uniform grid's resolution); min(1, q/p) does not."""
    rng = np.random.default_rng(0)
    for trial in range(3):
        p = rng.dirichlet(np.ones(5), size=2).astype(np.float32)  # row 0: the drafted slot; row 1: the bonus
        q = rng.dirichlet(np.ones(5) * (0.3 + trial), size=1).astype(np.float32)
        with monkeypatch.context() as patch:
            emitted = emitted_by_enumeration(p, q, sampling_module.speculative_accept, patch, grid=400)
        assert np.abs(emitted - p[0]).max() < 2 / 400, (emitted, p[0])

    def inverted(p, q, drafted, key, uniform):  # accept with min(1, q/p): wrong
        keep = uniform * p[0, drafted] < q[0, drafted]
        a = keep.astype(mx.int32).sum(keepdims=True)
        return sampling_module.sample(mx.concatenate([p[:1], p[1:]]), key), a
    with monkeypatch.context() as patch:
        emitted = emitted_by_enumeration(p, q, inverted, patch, grid=400)
    assert np.abs(emitted - p[0]).max() > 0.02


def test_probabilities_match_mlx_lm_sampler(setup):
    """Our p is the distribution mlx-lm's own sampler draws from (same filters and temperature)."""
    params = SamplingParams(temp=0.8, top_k=6, min_p=0.05)
    logits = mx.random.normal((1, VOCAB), key=mx.random.key(0)) * 2
    sampler = make_sampler(temp=0.8, top_k=6, min_p=0.05)
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    mx.random.seed(0)
    counts = np.bincount(np.array(mx.concatenate([sampler(logprobs) for _ in range(4000)])), minlength=VOCAB)
    stat, dof = chi_square(counts, np.array(params.probabilities(logits))[0])
    assert stat < chi_square_bound(dof)


def test_same_seed_same_text(setup):
    model, tokenizer, draft, prompt = setup
    tokenizer.eos_token_ids = set()
    runs = [generate(model, tokenizer, prompt, draft, max_tokens=30, sampling=SamplingParams(temp=1.0, seed=7))
            for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    other = generate(model, tokenizer, prompt, draft, max_tokens=30, sampling=SamplingParams(temp=1.0, seed=8))
    assert other.tokens != runs[0].tokens


def test_greedy_with_repetition_penalty_equals_mlx_lm(setup):
    model, tokenizer, draft, prompt = setup
    tokenizer.eos_token_ids = set()
    processors = make_logits_processors(repetition_penalty=1.5, repetition_context_size=8)
    expected = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=40, logits_processors=processors)]
    params = SamplingParams(temp=0.0, logits_processors=make_logits_processors(repetition_penalty=1.5,
                                                                             repetition_context_size=8))
    assert generate(model, tokenizer, prompt, draft, max_tokens=40, sampling=params).tokens == expected
    assert generate(model, tokenizer, prompt, draft, max_tokens=40, sampling=SamplingParams(temp=0.0)).tokens == \
        [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=40)]
