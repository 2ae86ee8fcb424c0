"""Draft checkpoints: the published format, round trips, and clear errors."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_models import MASK_ID, load_tiny, make_tiny_target, tiny_pair

from mlx_dflash import DFlashError, EngineOptions, create_random_draft, draft_cache, generate, load_draft, save_draft
from mlx_dflash.draft_config import default_target_layer_ids
from mlx_dflash.proposer import DFlashProposer
from mlx_dflash.target import Target, check_compatible

PUBLISHED_LAYER_KEYS = [
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
]


@pytest.fixture(scope="module")
def target(tiny_dir):
    path = make_tiny_target(tiny_dir / "io-qwen3", "qwen3")
    model, tokenizer = load_tiny(path)
    return path, model, tokenizer, json.loads((path / "config.json").read_text())


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]


def test_saved_files_use_published_names(target, tmp_path):
    _, _, _, config = target
    draft = create_random_draft(config, num_layers=2, mask_token_id=MASK_ID, target_layer_ids=[1, 4])
    save_draft(draft, tmp_path / "d")
    weights = mx.load(str(tmp_path / "d" / "model.safetensors"))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{k}" for i in range(2) for k in PUBLISHED_LAYER_KEYS}
    assert set(weights) == expected
    assert weights["fc.weight"].shape == (64, 2 * 64)
    saved = json.loads((tmp_path / "d" / "config.json").read_text())
    assert saved["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 4]}
    assert saved["block_size"] == 16 and saved["num_target_layers"] == 6


def test_round_trip_gives_identical_drafts(target, tmp_path):
    _, model, tokenizer, config = target
    draft = create_random_draft(config, num_layers=2, mask_token_id=MASK_ID)
    save_draft(draft, tmp_path / "d")
    loaded = load_draft(str(tmp_path / "d"))
    for (k1, v1), (k2, v2) in zip(tree_flatten(draft.parameters()), tree_flatten(loaded.parameters())):
        assert k1 == k2 and mx.array_equal(v1, v2)
    assert loaded.config.to_dict() == draft.config.to_dict()
    prompt = tokenizer.encode("abc")
    tokenizer.eos_token_ids = set()
    a = generate(model, tokenizer, prompt, draft, max_tokens=20)
    b = generate(model, tokenizer, prompt, loaded, max_tokens=20)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths


def test_a_large_draft_is_saved_in_shards_that_load_back(target, tmp_path):
    """Over the file limit: shards with an index, each under it; saved again whole, no stale shard stays."""
    _, _, _, config = target
    draft = create_random_draft(config, num_layers=2, mask_token_id=MASK_ID, intermediate_size=32)
    assert draft.config.intermediate_size == 32 and draft.layers[0].mlp.up_proj.weight.shape == (32, 64)
    limit = 40_000  # above the largest tensor (fc, 32 KB)
    save_draft(draft, tmp_path / "d", max_file_bytes=limit)
    files = sorted(p.name for p in (tmp_path / "d").glob("*.safetensors"))
    assert len(files) > 2 and "model.safetensors" not in files
    assert all((tmp_path / "d" / f).stat().st_size < limit + 4096 for f in files)
    index = json.loads((tmp_path / "d" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    assert set(index["weight_map"]) == {k for k, _ in tree_flatten(draft.parameters())}
    loaded = load_draft(str(tmp_path / "d"))
    for (k1, v1), (k2, v2) in zip(tree_flatten(draft.parameters()), tree_flatten(loaded.parameters())):
        assert k1 == k2 and mx.array_equal(v1, v2)
    assert loaded.config.intermediate_size == 32
    save_draft(loaded, tmp_path / "d")  # whole again: the shards and their index go
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    assert mx.array_equal(load_draft(str(tmp_path / "d")).fc.weight, draft.fc.weight)


def test_an_index_naming_a_missing_shard_is_a_clear_error(target, tmp_path):
    _, _, _, config = target
    save_draft(create_random_draft(config, num_layers=2, mask_token_id=MASK_ID), tmp_path / "d",
               max_file_bytes=20_000)
    next((tmp_path / "d").glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(DFlashError, match="missing: model-00002-of"):
        load_draft(str(tmp_path / "d"))


def test_loads_a_checkpoint_written_by_another_tool(target, tmp_path):
    """Weights written straight from the spec's key list (bf16, as published) load unchanged."""
    _, model, _, config = target
    rng = np.random.default_rng(0)
    H, I, hd = 64, 128, 16
    shapes = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    per_layer = {
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (4 * hd, H), "self_attn.k_proj.weight": (2 * hd, H),
        "self_attn.v_proj.weight": (2 * hd, H), "self_attn.o_proj.weight": (H, 4 * hd),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
    }
    shapes |= {f"layers.{i}.{k}": s for i in range(3) for k, s in per_layer.items()}
    weights = {k: mx.array(rng.standard_normal(s).astype(np.float32)).astype(mx.bfloat16) for k, s in shapes.items()}
    out = tmp_path / "published"
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hd,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": config["vocab_size"],
        "max_position_embeddings": 2048, "block_size": 16, "num_target_layers": 6,
        "dflash_config": {"mask_token_id": MASK_ID},
    }))
    draft = load_draft(str(out))
    assert draft.config.target_layer_ids == default_target_layer_ids(6, 3) == [1, 2, 3]
    assert mx.array_equal(draft.layers[2].mlp.down_proj.weight, weights["layers.2.mlp.down_proj.weight"])
    check_compatible(draft, model)


def test_incremental_context_equals_one_shot(target):
    """Feeding context in pieces through the draft cache gives the same block output."""
    _, _, _, config = target
    draft = create_random_draft(config, num_layers=2, mask_token_id=MASK_ID)
    mx.random.seed(1)
    context = draft.project_context(mx.random.normal((1, 10, 64 * 2)))
    block = mx.random.normal((1, 16, 64))
    one_shot = draft(block, context, draft.make_cache())
    cache = draft.make_cache()
    draft(block, context[:, :4], cache)  # a draft call that also stores the first 4 entries
    pieces = draft(block, context[:, 4:], cache)
    assert mx.allclose(one_shot, pieces, atol=1e-5)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}, "hidden size"),
        ({"num_hidden_layers": 8}, "expects 8 target layers"),
        ({"vocab_size": 1000}, "vocab size"),
    ],
)
def test_mismatched_draft_is_refused(target, override, message):
    _, model, _, config = target
    draft = create_random_draft({**config, **override}, num_layers=1, mask_token_id=MASK_ID, target_layer_ids=[1])
    with pytest.raises(DFlashError, match=message):
        check_compatible(draft, model)


def test_bad_mask_token_id_is_refused(target):
    _, model, _, config = target
    draft = create_random_draft(config, num_layers=1, mask_token_id=99999)
    with pytest.raises(DFlashError, match="mask token id 99999"):
        check_compatible(draft, model)


def test_missing_and_corrupt_files(target, tmp_path):
    _, _, _, config = target
    with pytest.raises(DFlashError, match="not found"):
        load_draft(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DFlashError, match="no config.json"):
        load_draft(str(empty))
    draft = create_random_draft(config, num_layers=1, mask_token_id=MASK_ID)
    save_draft(draft, tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(DFlashError, match="cannot read draft weights"):
        load_draft(str(tmp_path / "d"))
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(DFlashError, match="no \\*.safetensors"):
        load_draft(str(tmp_path / "d"))


def test_missing_tensor_is_refused(target, tmp_path):
    _, _, _, config = target
    save_draft(create_random_draft(config, num_layers=1, mask_token_id=MASK_ID), tmp_path / "d")
    weights = mx.load(str(tmp_path / "d" / "model.safetensors"))
    del weights["layers.0.mlp.up_proj.weight"]
    mx.save_safetensors(str(tmp_path / "d" / "model.safetensors"), weights)
    with pytest.raises(DFlashError, match="do not match its config"):
        load_draft(str(tmp_path / "d"))


def test_context_window_bounds_the_draft_cache_and_keeps_output_exact(tiny_dir):
    """A sink + window draft cache stays bounded, keeps absolute positions, round-trips in
    config.json, changes nothing while the context fits, and never changes the output."""
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "window-qwen3", "qwen3", "def f(x):", 60)
    config = dict(vars(model.args))
    draft = create_random_draft(config, num_layers=2, block_size=8, mask_token_id=MASK_ID)
    draft.config.context_window, draft.config.context_sink = 16, 2
    reloaded = load_draft(str(save_draft(draft, tiny_dir / "window-draft")))
    assert (reloaded.config.context_window, reloaded.config.context_sink) == (16, 2)
    assert generate(model, tokenizer, prompt, draft, max_tokens=60).tokens == reference
    features = mx.random.normal((1, 200, len(draft.config.target_layer_ids) * config["hidden_size"]))

    def drafted(window, positions, count=None):
        draft.config.context_window = window
        p = DFlashProposer(draft)
        p.start(Target(model, draft.config.target_layer_ids))
        p.add_context(features[:, :positions], count)
        return p, p.draft_logits(mx.array([5], dtype=mx.uint32), 7)

    proposer, windowed = drafted(16, 200)  # 200 > sink + window + slack: the middle is dropped
    assert proposer.cache[0].position == 200 and proposer.cache[0].bound == 2 + 16  # positions stored
    slack = draft_cache.COMPACT_SLACK
    try:  # the same window by a mask over all 200 positions (nothing dropped) sees the same
        draft_cache.COMPACT_SLACK = 1000
        proposer, masked = drafted(16, 200)
        assert proposer.cache[0].bound == 200
    finally:
        draft_cache.COMPACT_SLACK = slack
    assert mx.allclose(windowed, masked, atol=1e-5).item()
    # 12 context positions: a window of 16 holds them all
    assert mx.allclose(drafted(16, 12)[1], drafted(None, 12)[1], atol=1e-5).item()
    # a count still on the device: positions past it are not seen, and the next context lands over them
    _, on_device = drafted(None, 20, mx.array(12))
    assert mx.allclose(on_device, drafted(None, 12)[1], atol=1e-5).item()


def test_quantized_draft_loads_dequantized_on_the_cpu(target, tmp_path):
    """Off Apple GPUs a quantized draft is expanded to float (same numbers; BLAS speed on the CPU,
    no per-row-class kernel compiles on CUDA)."""
    import mlx.nn as nn

    from mlx_dflash.draft_io import quantize_draft

    draft = create_random_draft(target[3], num_layers=1, mask_token_id=MASK_ID)
    quantize_draft(draft, 8)
    path = save_draft(draft, tmp_path / "q8")
    loaded = load_draft(str(path), dtype=mx.float32)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.named_modules())
    assert "quantization" not in loaded.config.to_dict()
    x = mx.random.normal((1, 4, loaded.config.hidden_size))
    context = mx.random.normal((1, 6, loaded.config.hidden_size))
    same = [d(x, context, d.make_cache()) for d in (draft, loaded)]
    assert mx.allclose(same[0], same[1], atol=1e-4).item()


def test_half_precision_targets_on_the_cpu_get_a_warning(tiny_dir, capsys):
    """bfloat16 on the CPU bypasses BLAS (a 1.5B 4-bit forward took 92 s here): say so."""
    from mlx_dflash.target import load_target

    path = make_tiny_target(tiny_dir / "half-qwen3", "qwen3")
    load_target(str(path))
    assert "warning" not in capsys.readouterr().err  # float32: nothing to say
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    weights = mx.load(str(path / "model.safetensors"))
    mx.save_safetensors(str(path / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    load_target(str(path))
    assert "runs in bfloat16 on the CPU" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["window", "all context", "sliding layer"])
def test_compiled_draft_pass_equals_eager_one(tiny_dir, layout):
    """What GPUs run: the draft's decode pass under mx.compile (whole context buffers, lengths
    as arrays) gives the eager pass's logits: after a count still on the device, a settle that
    drops the window's middle, and a buffer grown past 256 positions."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / "compiled-draft-qwen3", "qwen3"))
    config = dict(vars(model.args))
    draft = create_random_draft(config, num_layers=2, block_size=16, mask_token_id=MASK_ID)
    if layout == "window":
        draft.config.context_window, draft.config.context_sink = 100, 4
    if layout == "sliding layer":
        draft.config.layer_types, draft.config.sliding_window = ["sliding_attention", "full_attention"], 40
    mx.random.seed(3)
    features = mx.random.normal((1, 300, len(draft.config.target_layer_ids) * config["hidden_size"]))
    first = mx.array([5], dtype=mx.uint32)

    def passes(compiled: bool) -> list[mx.array]:
        proposer = DFlashProposer(draft)  # (the GPU's reads: whole buffers)
        proposer.start(Target(model, draft.config.target_layer_ids, EngineOptions(pad_reads=True, compile_draft=compiled)))
        proposer.add_context(features[:, :200])
        out = [proposer.draft_logits(first, 15)]
        proposer.add_context(features[:, 200:216], mx.array(9))  # a count on the device
        out.append(proposer.draft_logits(first, 7))
        proposer.settle(209)  # (with the window: its middle is dropped)
        proposer.add_context(features[:, 216:290])  # past 256 stored positions (no window)
        out.append(proposer.draft_logits(first, 15))
        return out

    compiled, eager = passes(True), passes(False)
    assert draft._compiled_pass is not None  # (it ran)
    for a, b in zip(compiled, eager):
        assert mx.abs(a - b).max().item() <= 1e-4
    # new weights (training evaluates between its steps): the trace uses them, not the old ones
    draft.update({"layers": [{"mlp": {"down_proj": {"weight": 2 * layer.mlp.down_proj.weight}}} for layer in draft.layers]})
    compiled, eager = passes(True), passes(False)
    assert mx.abs(compiled[0] - eager[0]).max().item() <= 1e-4


def test_a_device_count_gives_all_draft_layers_one_length(target):
    """Context stored with a count on the device: every layer's length (and position) is one
    array, not an op a layer (each a kernel launch on a GPU)."""
    _, model, _, config = target
    draft = create_random_draft(config, num_layers=3, mask_token_id=MASK_ID)
    proposer = DFlashProposer(draft)
    proposer.start(Target(model, draft.config.target_layer_ids))
    features = mx.random.normal((1, 30, len(draft.config.target_layer_ids) * config["hidden_size"]))
    proposer.add_context(features[:, :20])
    for _ in range(2):  # from an int length, then from the device length the first left
        proposer.add_context(features[:, 20:25], mx.array(3))
        lengths = [c.length for c in proposer.cache]
        assert all(x is lengths[0] for x in lengths) and all(c.position is lengths[0] for c in proposer.cache)
    assert lengths[0].item() == 26


@pytest.mark.parametrize("compiled", [False, True])
def test_packed_draft_passes_equal_plain_ones(tiny_dir, compiled):
    """Passes with q/k/v and gate/up packed and products row by row (the GPU's) give the plain
    pass's logits; new weights (training) are packed afresh, not the old ones kept."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / "packed-draft-qwen3", "qwen3"))
    config = dict(vars(model.args))
    draft = create_random_draft(config, num_layers=2, block_size=16, mask_token_id=MASK_ID)
    mx.random.seed(4)
    features = mx.random.normal((1, 40, len(draft.config.target_layer_ids) * config["hidden_size"]))
    first = mx.array([5], dtype=mx.uint32)

    def logits(packed: bool) -> mx.array:
        options = EngineOptions(compile_draft=compiled, pack_draft=packed, rowwise_products=True)
        proposer = DFlashProposer(draft)
        proposer.start(Target(model, draft.config.target_layer_ids, options))
        proposer.add_context(features)
        return proposer.draft_logits(first, 15)

    for _ in range(2):
        packed, plain = logits(True), logits(False)
        assert draft._pass_projections is not None and len(draft._pass_projections.swaps) == 2 * 7 + 1  # (and fc)
        assert mx.abs(packed - plain).max().item() <= 1e-4 * mx.abs(plain).max().item()
        draft.update({"layers": [{"self_attn": {"v_proj": {"weight": 2 * layer.self_attn.v_proj.weight}}}
                                 for layer in draft.layers]})
        assert draft._pass_projections is None
