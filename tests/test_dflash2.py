"""DFlash2 drafts: the format, the convolution and the selector pinned by independent
references, an identity-initialised v2 draft proposing exactly v1's drafts, and greedy output
equal to mlx-lm's on every family; sliding-window layers honour ``is_causal``."""

import json

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
import numpy as np
import pytest
from tiny_models import FAMILIES, MASK_ID, MORE_FAMILIES, VOCAB_SIZE, tiny_pair

from mlx_dflash import DFlashError, EngineOptions, create_random_draft, generate, load_draft, save_draft
from mlx_dflash.draft import CandidateSelector, block_conv, follow_picks, to_dflash2, top_k_columns
from mlx_dflash.draft_cache import DraftContextCache, block_mask
from mlx_dflash.draft_config import DFlash2Config, DraftConfig
from mlx_dflash.proposer import DFlashProposer
from mlx_dflash.sampling import SamplingParams
from mlx_dflash.target import Target

V2 = DFlash2Config(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
MAX_TOKENS = 40


def _config(model) -> dict:
    return vars(getattr(model, "language_model", model).args)


def trained_looking(draft, seed: int = 1):
    """Non-identity convolutions and selector weights, as a trained v2 draft has."""
    rng = np.random.default_rng(seed)
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv) if "attention_conv" in layer else ():
            conv.base_kernel = conv.base_kernel + mx.array(rng.normal(0, 0.3, conv.base_kernel.shape), mx.float32)
            conv.kernel_projection.weight = mx.array(rng.normal(0, 0.1, conv.kernel_projection.weight.shape),
                                                     mx.float32)
    selector = draft.candidate_selector
    selector.successor_codebook.weight = mx.array(rng.normal(0, 1.0, selector.successor_codebook.weight.shape), mx.float32)
    selector.predecessor_codebook.weight = mx.array(rng.normal(0, 1.0, selector.predecessor_codebook.weight.shape),
                                                    mx.float32)
    mx.eval(draft.parameters())
    return draft


@pytest.mark.parametrize("taps, length", [(2, 7), (3, 5), (2, 1)])
def test_block_conv_is_the_per_element_formula(taps, length):
    rng = np.random.default_rng(taps)
    hidden, group = 32, 8
    y = rng.normal(size=(2, length, hidden)).astype(np.float32)
    deltas = rng.normal(size=(2, length, taps, hidden // group)).astype(np.float32)
    base = rng.normal(size=(taps, hidden)).astype(np.float32)
    expected = np.zeros_like(y)
    for b in range(2):
        for t in range(length):
            for c in range(hidden):
                for tap in range(taps):
                    if t - tap >= 0:  # (nothing before the block's start)
                        expected[b, t, c] += (base[tap, c] + deltas[b, t, tap, c // group]) * y[b, t - tap, c]
    got = block_conv(mx.array(y), mx.array(deltas), mx.array(base), group)
    assert np.abs(np.array(got) - expected).max() < 1e-5


@pytest.mark.parametrize("with_ids", [False, True])
def test_selector_walk_is_the_brute_force_one(with_ids):
    rng = np.random.default_rng(7)
    vocab, rank, hidden, n, k = 30, 6, 12, 5, 4
    selector = CandidateSelector(hidden, vocab, rank)
    selector.predecessor_codebook.weight = mx.array(rng.normal(size=(vocab, rank)), mx.float32)
    selector.successor_codebook.weight = mx.array(rng.normal(size=(vocab, rank)), mx.float32)
    h = rng.normal(size=(n, hidden)).astype(np.float32)
    ids = np.array(rng.choice(vocab, size=12, replace=False)) if with_ids else None
    logits = rng.normal(size=(n, 12 if with_ids else vocab)).astype(np.float32) * 3
    got, q = selector.walk(mx.array(h), mx.array(logits), mx.array([3]), k, None if ids is None else mx.array(ids))
    assert q is None  # (greedy)
    g = np.array(selector.hidden_projection(mx.array(h)))
    pred, succ = np.array(selector.predecessor_codebook.weight), np.array(selector.successor_codebook.weight)
    previous, expected = 3, []
    for t in range(n):
        top = np.argsort(-logits[t])[:k]  # the head's top-k (local indices)
        best = max(top, key=lambda j: logits[t][j] + float(
            np.sum(pred[previous] * g[t] * succ[ids[j] if with_ids else j])))
        previous = int(ids[best]) if with_ids else int(best)
        expected.append(previous)
    assert np.array(got).tolist() == expected


@pytest.mark.parametrize("width", [8192, 1000, 64])
def test_top_k_columns_are_the_k_largest(width):
    """Two stages on the CPU (width 8,192: the 16 groups of 16 with the largest maxima, then their
    top 16), one argpartition where a row is not whole groups (1,000) or too narrow (64)."""
    logits = np.random.default_rng(width).normal(size=(3, 15, width)).astype(np.float32)  # (a batch's rows of slots)
    got = np.sort(np.array(top_k_columns(mx.array(logits), 16)), axis=-1)
    assert (got == np.sort(np.argsort(-logits, axis=-1)[..., :16], axis=-1)).all()
    assert (np.sort(np.array(top_k_columns(mx.array(logits[0]), 16)), axis=-1) == got[0]).all()


@pytest.mark.parametrize("n", [1, 2, 7, 15, 16])
def test_following_picks_by_pointer_doubling_is_the_slot_by_slot_walk(n):
    picks = np.random.default_rng(n).integers(0, 5, size=(n, 5))
    row, expected = 0, []
    for t in range(n):
        row = int(picks[t, row])
        expected.append(row)
    assert np.array(follow_picks(mx.array(picks))).tolist() == expected


@pytest.fixture(scope="module")
def qwen3_pair(tiny_dir):
    return tiny_pair(tiny_dir / "dflash2-qwen3", "qwen3", "def fib(n):\n    return", MAX_TOKENS)


def _proposals(model, draft, dtype=mx.float32) -> list[int]:
    """The draft's 7 proposals after token 5, following 20 positions of random target features."""
    width = len(draft.config.target_layer_ids) * draft.config.hidden_size
    proposer = DFlashProposer(draft)
    proposer.start(Target(model, draft.config.target_layer_ids))
    proposer.add_context(mx.random.normal((1, 20, width), key=mx.random.key(2)).astype(dtype))
    return proposer.propose(mx.array([5], dtype=mx.uint32), 7).tolist()


def test_an_identity_v2_draft_proposes_what_the_same_v1_draft_does(qwen3_pair):
    """Base tap 0 = 1, tap 1 = 0, kernel projections 0, successor codebook 0: the v2 draft's
    layers are v1's and its selector keeps the head's argmax."""
    model, tokenizer, prompt, reference = qwen3_pair
    v1 = create_random_draft(_config(model), num_layers=2, block_size=8, mask_token_id=MASK_ID, seed=3)
    v2 = create_random_draft(_config(model), num_layers=2, block_size=8, mask_token_id=MASK_ID, seed=9, dflash2=V2)
    v2.load_weights(list(tree_flatten(v1.parameters())), strict=False)  # (v1's weights; v2's own stay identity)
    assert _proposals(model, v1) == _proposals(model, v2)
    runs = [generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS) for draft in (v1, v2)]
    assert runs[0].tokens == runs[1].tokens == reference[:MAX_TOKENS]
    assert runs[0].acceptance_lengths == runs[1].acceptance_lengths


def test_a_v1_drafts_dflash2_copy_keeps_its_dtype(qwen3_pair):
    """``to_dflash2`` of a bfloat16 draft: every weight bfloat16 (a float32 convolution kernel would
    cast the activations back and forth), the same drafts."""
    model, *_ = qwen3_pair
    v1 = create_random_draft(_config(model), num_layers=2, block_size=8, mask_token_id=MASK_ID, seed=3)
    v1.set_dtype(mx.bfloat16)
    v2 = to_dflash2(v1)
    assert {w.dtype for _, w in tree_flatten(v2.parameters())} == {mx.bfloat16}
    assert _proposals(model, v1, mx.bfloat16) == _proposals(model, v2, mx.bfloat16)


@pytest.mark.parametrize("family", [*FAMILIES, *MORE_FAMILIES])
def test_v2_greedy_output_is_mlx_lms(tiny_dir, family):
    """A v2 draft with non-identity convolutions and selector: fixed blocks, adaptive, the GPUs'
    queued and compiled paths, a sampled run through its head's distribution, and trees."""
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / f"dflash2-{family}", family, "def fib(n):", MAX_TOKENS)
    draft = trained_looking(create_random_draft(_config(model), num_layers=2, block_size=8, mask_token_id=MASK_ID,
                                                dflash2=V2))
    for adaptive in (False, True):
        assert generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, adaptive=adaptive).tokens == reference
    gpu_paths = EngineOptions(queue_ahead=True, pad_reads=True, compile_blocks=True, compile_draft=True,
                              pack_draft=True, rowwise_products=True)  # (what GPUs run, forced here)
    assert generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, options=gpu_paths).tokens == reference
    sampled = generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, sampling=SamplingParams(temp=1.0, top_k=1))
    assert sampled.tokens == reference
    # trees from its head's marginals, built on the host and on the device (where targets allow trees)
    device_trees = EngineOptions(queue_ahead=True, compile_blocks=True, device_trees=True)
    for options in (EngineOptions(), device_trees):
        assert generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, trees=16, options=options).tokens == reference


def test_v2_format_round_trip(qwen3_pair, tmp_path):
    model, *_ = qwen3_pair
    draft = trained_looking(create_random_draft(_config(model), num_layers=2, block_size=8, mask_token_id=MASK_ID,
                                                dflash2=V2))
    path = save_draft(draft, tmp_path / "v2")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                    "selector_top_k", "block_size")} == {**V2.to_dict(), "block_size": 8}
    keys = set(mx.load(str(path / "model.safetensors")))
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.1.mlp_conv.kernel_projection.weight"} <= keys  # (codebooks with no .weight suffix)
    loaded = load_draft(str(path))
    assert loaded.config.dflash2 == V2 and loaded.block_size == 8
    for (name, a), (_, b) in zip(sorted(tree_flatten(draft.parameters())),
                                 sorted(tree_flatten(loaded.parameters()))):
        assert mx.array_equal(a, b).item(), name
    # block_size inside dflash_config wins over a top-level one
    config["block_size"] = 16
    (path / "config.json").write_text(json.dumps(config))
    assert load_draft(str(path)).block_size == 8


def test_a_v2_draft_without_convolutions(qwen3_pair, tmp_path):
    """``conv_kernel_size`` 0: v1's layers and the selector. No convolution weights on disk, the
    config round-trips, and its greedy output is mlx-lm's (fixed, adaptive, the GPUs' paths); a
    negative count fails with one line."""
    import dataclasses

    model, tokenizer, prompt, reference = qwen3_pair
    no_convs = dataclasses.replace(V2, conv_kernel_size=0)
    draft = trained_looking(create_random_draft(_config(model), num_layers=2, block_size=8, mask_token_id=MASK_ID,
                                                dflash2=no_convs))
    path = save_draft(draft, tmp_path / "v2")
    keys = set(mx.load(str(path / "model.safetensors")))
    assert "candidate_selector.successor_codebook" in keys and not any("conv" in k for k in keys)
    loaded = load_draft(str(path))
    assert loaded.config.dflash2 == no_convs
    gpu_paths = EngineOptions(queue_ahead=True, pad_reads=True, compile_blocks=True, compile_draft=True, pack_draft=True)
    for adaptive, options in [(False, EngineOptions()), (True, EngineOptions()), (False, gpu_paths)]:
        assert generate(model, tokenizer, prompt, loaded, max_tokens=MAX_TOKENS, adaptive=adaptive,
                        options=options).tokens == reference[:MAX_TOKENS]
    config = json.loads((path / "config.json").read_text())
    config["dflash_config"]["conv_kernel_size"] = -1
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="dflash_config.conv_kernel_size must be a count"):
        load_draft(str(path))


def test_malformed_v2_drafts_fail_with_one_line(qwen3_pair, tmp_path):
    model, *_ = qwen3_pair
    draft = create_random_draft(_config(model), num_layers=1, block_size=8, mask_token_id=MASK_ID, dflash2=V2)
    path = save_draft(draft, tmp_path / "v2")
    config = json.loads((path / "config.json").read_text())
    config["dflash_config"]["conv_group_size"] = 7
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="not a multiple of dflash_config.conv_group_size"):
        load_draft(str(path))
    config["dflash_config"]["conv_group_size"] = 16
    config["dflash_config"]["selector_rank"] = 5  # the codebooks on disk have rank 8
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DFlashError, match="do not match its config"):
        load_draft(str(path))
    weights = {k: v for k, v in mx.load(str(path / "model.safetensors")).items() if "codebook" not in k}
    config["dflash_config"]["selector_rank"] = 8
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(DFlashError, match="do not match its config"):
        load_draft(str(path))


def test_scales_from_the_config_are_honoured(qwen3_pair):
    model, *_ = qwen3_pair
    raw = create_random_draft(_config(model), num_layers=1, mask_token_id=MASK_ID).config.to_dict()
    raw.update(input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=3.0)
    config = DraftConfig.from_dict(raw)
    from mlx_dflash.draft import DFlashDraft

    draft = DFlashDraft(config)
    x = mx.array([[-10.0, 0.0, 4.0]])
    assert mx.allclose(draft.scale_logits(x), 3.0 * mx.tanh(x * 0.5 / 3.0)).item()
    assert mx.allclose(draft.scale_embeddings(x), 2 * x).item()
    assert DraftConfig.from_dict(config.to_dict()).final_logit_softcapping == 3.0


def test_sliding_windows_honour_is_causal():
    """v1's published rule: a sliding-window layer is causal; with ``is_causal: false``
    (DFlash2's checkpoints) the window is two-sided and the block stays non-causal."""
    cache = DraftContextCache()
    cache.add(mx.zeros((1, 1, 20, 4)), mx.zeros((1, 1, 20, 4)))
    causal = np.array(block_mask(cache, 4, 8, causal=True))
    two_sided = np.array(block_mask(cache, 4, 8, causal=False))
    assert causal[:, 20:].tolist() == np.tril(np.ones((4, 4), bool)).tolist()
    assert two_sided[:, 20:].all()
    assert (causal[:, :20] == two_sided[:, :20]).all()  # the context window is the same
    assert two_sided[0, :20].tolist() == [False] * 13 + [True] * 7  # 20 - 7 .. 19 within 8 of position 20
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "vocab_size": VOCAB_SIZE, "num_target_layers": 6, "dflash_config": {"mask_token_id": MASK_ID},
            "layer_types": ["sliding_attention"], "sliding_window": 8}
    assert DraftConfig.from_dict(base).causal_windows
    assert not DraftConfig.from_dict({**base, "is_causal": False}).causal_windows
    with pytest.raises(DFlashError, match="is_causal must be true or false"):
        DraftConfig.from_dict({**base, "is_causal": "no"})


def test_a_sampled_walk_draws_from_the_q_it_reports():
    """With a temperature each slot's candidate is drawn from softmax(S / T) over the top-k,
    and q is that distribution on the vocabulary: rows sum to 1 on exactly k ids, and the
    drawn token is one of them."""
    rng = np.random.default_rng(3)
    selector = CandidateSelector(8, 20, 4)
    selector.successor_codebook.weight = mx.array(rng.normal(size=(20, 4)), mx.float32)
    logits = mx.array(rng.normal(size=(3, 20)), mx.float32)
    drafted, q = selector.walk(mx.array(rng.normal(size=(3, 8)), mx.float32), logits, mx.array([1]), 5, None, 0.8,
                               mx.random.key(0))
    q = np.array(q)
    assert np.allclose(q.sum(axis=1), 1.0, atol=1e-5) and ((q > 0).sum(axis=1) == 5).all()
    assert all(q[t, d] > 0 for t, d in enumerate(np.array(drafted)))


def test_sampled_walks_follow_the_chain_of_selector_distributions():
    """Many sampled walks of two slots: the frequency of each (first, second) pair is
    softmax(S0 / T)[first] x softmax(S1 | first / T)[second] (the brute-force scores), and each
    walk's reported q rows are those two distributions."""
    rng = np.random.default_rng(5)
    vocab, rank, hidden, k, temperature, draws = 6, 3, 4, 3, 0.8, 4000
    selector = CandidateSelector(hidden, vocab, rank)
    selector.predecessor_codebook.weight = mx.array(rng.normal(size=(vocab, rank)), mx.float32)
    selector.successor_codebook.weight = mx.array(rng.normal(size=(vocab, rank)), mx.float32)
    h, logits = rng.normal(size=(2, hidden)).astype(np.float32), rng.normal(size=(2, vocab)).astype(np.float32)
    g = np.array(selector.hidden_projection(mx.array(h)))
    pred, succ = np.array(selector.predecessor_codebook.weight), np.array(selector.successor_codebook.weight)

    def distribution(t: int, previous: int) -> np.ndarray:
        top = np.argsort(-logits[t])[:k]
        scores = np.array([logits[t][j] + np.sum(pred[previous] * g[t] * succ[j]) for j in top]) / temperature
        p = np.zeros(vocab)
        p[top] = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
        return p

    expected = np.outer(distribution(0, 2), np.ones(vocab))
    expected *= np.stack([distribution(1, a) for a in range(vocab)])
    counts = np.zeros((vocab, vocab))
    for key in mx.random.split(mx.random.key(0), draws):
        drafted, q = selector.walk(mx.array(h), mx.array(logits), mx.array([2]), k, None, temperature, key)
        first, second = np.array(drafted).tolist()
        counts[first, second] += 1
    assert np.allclose(np.array(q), [distribution(0, 2), distribution(1, first)], atol=1e-5)
    assert np.abs(counts / draws - expected).max() < 0.03, (counts / draws, expected)


@pytest.mark.parametrize("window", [None, "causal", "two-sided"])
def test_training_forward_of_blocks_equals_the_decode_pass(qwen3_pair, window):
    """The training forward (many anchored blocks in one pass, each block's convolutions from
    its own start) gives each block what the decode pass gives it over the same context; with
    a sliding window of 3 in the last layer (causal, or two-sided: ``is_causal: false``) too."""
    import dataclasses

    from mlx_dflash.draft import DFlashDraft
    from mlx_dflash.train import context_visibility

    model, *_ = qwen3_pair
    draft = trained_looking(create_random_draft(_config(model), num_layers=2, block_size=4, mask_token_id=MASK_ID,
                                                dflash2=V2))
    if window is not None:
        windowed = DFlashDraft(dataclasses.replace(draft.config, sliding_window=3, is_causal=window == "causal",
                                                   layer_types=["full_attention", "sliding_attention"]))
        windowed.update(draft.parameters())
        draft = windowed
    H = draft.config.hidden_size
    context = draft.project_context(mx.random.normal((1, 12, 2 * H), key=mx.random.key(4)))
    anchors = mx.array([[3, 7]])
    blocks = mx.random.normal((1, 8, H), key=mx.random.key(5))
    together = draft.forward_blocks(blocks, context, anchors, context_visibility(anchors, 12))
    for i, anchor in enumerate((3, 7)):
        cache = draft.make_cache()
        draft.store_context(context[:, :anchor], cache)
        alone = draft(blocks[:, 4 * i : 4 * i + 4], None, cache)
        assert mx.abs(alone - together[:, 4 * i : 4 * i + 4]).max().item() < 1e-4


def test_dflash2_training_runs_and_fine_tunes_a_v1_draft(tmp_path, tiny_dir):
    """--arch dflash2: block loss plus the selector loss falls, the draft saves and reloads as v2;
    with --init a v1 draft becomes its identity start, and a draft with a sliding window keeps it."""
    import dataclasses

    from tiny_models import load_tiny, make_tiny_target

    from mlx_dflash.data import build_dataset, stdlib_prompts
    from mlx_dflash.draft import DFlashDraft
    from mlx_dflash.train import TrainConfig, train

    model, tokenizer = load_tiny(make_tiny_target(tiny_dir / "dflash2-train", "qwen3"))
    data = build_dataset(model, tokenizer, stdlib_prompts()[:12], tiny_dir / "dflash2-train-data", max_tokens=48,
                         batch_size=6)
    base = dict(block_size=8, mask_token_id=MASK_ID, batch_size=4, anchors=16, lr=3e-3, eval_every=0,
                eval_prompts=0, save_every=0)
    cfg = TrainConfig(**base, layers=1, steps=40, arch="dflash2")
    v2_dir = train(model, tokenizer, [str(data)], str(tmp_path / "v2"), cfg)
    losses = [h["loss"] for h in cfg.history if "loss" in h]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    trained = load_draft(str(v2_dir))
    assert trained.config.dflash2 is not None
    assert mx.abs(trained.candidate_selector.successor_codebook.weight).max().item() > 0  # (the selector loss trains it)
    v1_dir = train(model, tokenizer, [str(data)], str(tmp_path / "v1"), TrainConfig(**base, layers=1, steps=4))
    tuned = train(model, tokenizer, [str(data)], str(tmp_path / "tuned"), TrainConfig(**base, steps=1, arch="dflash2"),
                  init=str(v1_dir))
    assert load_draft(str(tuned)).config.dflash2 is not None
    # a published DFlash2 layout, a two-sided sliding window: it fine-tunes with the window it decodes with
    windowed = DFlashDraft(dataclasses.replace(trained.config, sliding_window=4, is_causal=False,
                                               layer_types=["sliding_attention"]))
    windowed.update(trained.parameters())
    save_draft(windowed, tmp_path / "windowed")
    tuned = load_draft(str(train(model, tokenizer, [str(data)], str(tmp_path / "windowed-tuned"),
                                 TrainConfig(**base, steps=2, arch="dflash2"), init=str(tmp_path / "windowed"))))
    assert tuned.config.is_sliding(0) and tuned.config.sliding_window == 4 and not tuned.config.causal_windows

    # --kernel-lr-scale 0: the kernel projections keep their identity start while the rest learns,
    # and the two optimizers' state survives a resume.
    frozen = dict(base, kernel_lr_scale=0.0, arch="dflash2", save_every=2)
    out = tmp_path / "frozen"
    train(model, tokenizer, [str(data)], str(out), TrainConfig(**frozen, steps=2), init=str(v1_dir))
    resumed = train(model, tokenizer, [str(data)], str(out), TrainConfig(**frozen, steps=4), resume=True)
    weights = dict(tree_flatten(load_draft(str(resumed)).parameters()))
    start = dict(tree_flatten(load_draft(str(v1_dir)).parameters()))
    projections = [k for k in weights if "kernel_projection" in k]
    assert projections and all(mx.abs(weights[k]).max().item() == 0 for k in projections)
    assert any(not mx.array_equal(weights[k], start[k]).item() for k in start if k in weights)

    # A DFlash2 --init draft trains as one (its selector's rate applies) without --arch; a v1 one
    # refuses the DFlash2 rates rather than ignoring them.
    again = TrainConfig(**base, steps=1, selector_lr_scale=10.0)
    train(model, tokenizer, [str(data)], str(tmp_path / "again"), again, init=str(v2_dir))
    assert again.arch == "dflash2"
    with pytest.raises(DFlashError, match="shape a DFlash2 draft: train one with --arch dflash2"):
        train(model, tokenizer, [str(data)], str(tmp_path / "v1-scaled"), TrainConfig(**base, steps=1, selector_lr_scale=10.0),
              init=str(v1_dir))
    assert not (tmp_path / "v1-scaled").exists()

    # --conv-taps 0: a fine-tune of the v1 draft into v1's layers and a selector (no convolutions);
    # a DFlash2 --init draft keeps its own taps.
    selector_only = train(model, tokenizer, [str(data)], str(tmp_path / "selector-only"),
                          TrainConfig(**base, steps=2, arch="dflash2", conv_taps=0), init=str(v1_dir))
    loaded = load_draft(str(selector_only))
    assert loaded.config.dflash2.conv_kernel_size == 0 and "attention_conv" not in loaded.layers[0]
    with pytest.raises(DFlashError, match="--conv-taps 0: the --init draft's convolutions have 2 taps"):
        train(model, tokenizer, [str(data)], str(tmp_path / "retapped"), TrainConfig(**base, steps=1, conv_taps=0),
              init=str(v2_dir))


@pytest.mark.parametrize("kernel, selector", [(0.1, 10.0), (1.0, 1.0)])
def test_kernel_projections_and_selector_learn_at_their_scales_of_lr(qwen3_pair, kernel, selector):
    """One AdamW step from the identity start (zero kernel projections and successor codebook,
    equal gradients everywhere): each part moves by its scale times the rate, the rest by the rate."""
    from mlx_dflash.train import TrainConfig, make_optimizer

    model = qwen3_pair[0]
    draft = create_random_draft(_config(model), num_layers=1, block_size=8, mask_token_id=MASK_ID, dflash2=V2)
    cfg = TrainConfig(arch="dflash2", kernel_lr_scale=kernel, selector_lr_scale=selector)
    optimizer = make_optimizer(cfg, lambda step: mx.array(1e-3))
    grads = tree_map(mx.ones_like, draft.trainable_parameters())
    optimizer.update(draft, grads)
    moved = dict(tree_flatten(draft.parameters()))
    step = lambda name: mx.abs(moved[name]).max().item()  # noqa: E731 (each started at zero)
    rate = 1e-3 * 0.1 / 0.001**0.5  # (Adam's first step without bias correction: (1 - b1) / sqrt(1 - b2))
    assert step("layers.0.mlp_conv.kernel_projection.weight") == pytest.approx(kernel * rate, rel=1e-3)
    assert step("candidate_selector.successor_codebook.weight") == pytest.approx(selector * rate, rel=1e-3)


@pytest.mark.parametrize("rank", [8, 64])
def test_a_quantized_v2_draft_with_a_draft_vocabulary_keeps_greedy_output(qwen3_pair, tmp_path, rank):
    """8-bit storage (expanded at load off Apple GPUs) and a draft vocabulary: the selector walks
    the vocabulary head's top-k, mapped back to token ids. Codebooks of whole quantization groups
    (rank 64) are stored in 8 bits too, narrower ones in float."""
    from mlx_dflash.draft_io import dequantize_draft, quantize_draft

    model, tokenizer, prompt, reference = qwen3_pair
    v2 = DFlash2Config(**{**vars(V2), "selector_rank": rank})
    draft = trained_looking(create_random_draft(_config(model), num_layers=1, block_size=8, mask_token_id=MASK_ID,
                                                dflash2=v2))
    draft.config.draft_vocab = sorted(set(reference) | set(range(0, VOCAB_SIZE, 3)))
    quantize_draft(draft, 8)
    path = save_draft(draft, tmp_path / "q8")
    stored = mx.load(str(path / "model.safetensors"))
    assert ("candidate_selector.successor_codebook.scales" in stored) == (rank == 64)
    assert ("candidate_selector.successor_codebook" in stored) == (rank == 8)  # (the published name)
    kept = load_draft(str(path))  # (quantized, as on Apple GPUs): the same drafts as before saving
    first = mx.array([reference[0]])
    hidden, logits = mx.random.normal((7, draft.config.hidden_size)), mx.random.normal((7, VOCAB_SIZE))
    ours, theirs = (d.candidate_selector.walk(hidden, logits, first, 4)[0] for d in (draft, kept))
    assert mx.array_equal(ours, theirs).item()
    plain = mx.load(str(save_draft(dequantize_draft(kept, mx.float32), tmp_path / "plain") / "model.safetensors"))
    assert "candidate_selector.successor_codebook" in plain  # (dequantized: the published name again)
    loaded = load_draft(str(path), dtype=mx.float32)
    assert loaded.config.dflash2 == v2 and loaded.config.draft_vocab == draft.config.draft_vocab
    result = generate(model, tokenizer, prompt, loaded, max_tokens=MAX_TOKENS)
    assert result.tokens == reference[:MAX_TOKENS]
