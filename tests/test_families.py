"""Every supported target family beyond dense attention: DFlash equals mlx-lm greedy, and
each cache type rolls back to exactly the state of decoding only the accepted tokens."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache
from tiny_models import MASK_ID, MORE_FAMILIES, VOCAB_SIZE, greedy_reference, load_tiny, make_tiny_target, tiny_pair

from mlx_dflash import EngineOptions, create_random_draft, generate
from mlx_dflash.draft_io import quantize_draft
from mlx_dflash.engine import decode_cycles
from mlx_dflash.errors import DFlashError
from mlx_dflash.generate import make_proposer
from mlx_dflash.replay import ReplayProposer
from mlx_dflash.target import Target

MAX_TOKENS = 64
# What GPUs run, forced on the CPU: blocks queued ahead, whole buffers read, blocks and draft
# passes compiled, projections row by row
GPU_PATHS = EngineOptions(queue_ahead=True, pad_reads=True, compile_blocks=True, compile_draft=True,
                          rowwise_products=True)
# planted mistakes: acceptance lengths 1, 4, 8, 16, 2, 15, ... within one sequence
SCHEDULE = [0, 3, 7, None, 1, 14, 5]


def _config(model) -> dict:
    return vars(getattr(model, "language_model", model).args)


@pytest.fixture(scope="module", params=list(MORE_FAMILIES))
def family_pair(request, tiny_dir):
    family = request.param
    return family, *tiny_pair(tiny_dir / f"family-{family}", family, "def fib(n):\n    return", 3 * MAX_TOKENS)


def test_random_draft_equals_greedy(family_pair):
    family, model, tokenizer, prompt, reference = family_pair
    draft = create_random_draft(_config(model), num_layers=1, block_size=16, mask_token_id=MASK_ID)
    result = generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS)
    assert result.tokens == reference[:MAX_TOKENS]


def test_draft_tapping_one_layer_twice_equals_greedy(family_pair):
    """Five taps on a shallow target repeat layers (the reference rule gives [1, 1, 1, 1, 1] for
    4 layers): each layer is wrapped once (layer 1 is a recurrent one in the hybrids) and its
    output fed to every tap that names it."""
    family, model, tokenizer, prompt, reference = family_pair
    draft = create_random_draft(_config(model), num_layers=5, block_size=16, mask_token_id=MASK_ID,
                                target_layer_ids=[1, 1, 2, 3, 3])
    result = generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS)
    assert result.tokens == reference[:MAX_TOKENS]


def test_planted_acceptance_lengths_equal_greedy(family_pair):
    """Partial acceptance of every kind, long enough for sliding windows (8) to wrap many times."""
    family, model, tokenizer, prompt, reference = family_pair
    proposer = ReplayProposer(prompt + reference, 16, SCHEDULE, VOCAB_SIZE)
    result = generate(model, tokenizer, prompt, proposer, max_tokens=3 * MAX_TOKENS)
    assert result.tokens == reference
    # (the last cycle's block may be queued before the host knows how many tokens are left)
    assert sorted(set(result.acceptance_lengths[:-1])) == [1, 2, 4, 6, 8, 15, 16]


@pytest.mark.parametrize("length", [1, 40, 2048 + 17])
def test_prefill_gives_mlx_lms_first_logits_bit_for_bit(tiny_dir, length):
    """The prompt goes through the target in mlx-lm's calls (all but the last token in chunks,
    then the last alone), so the first token's logits are mlx-lm's bit for bit, not the last
    row of a chunk (which differs in its last bits: a bf16 near-tie on a GPU can flip)."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_dflash.engine import prefill
    from mlx_dflash.proposer import DFlashProposer

    model, _ = load_tiny(make_tiny_target(tiny_dir / "prefill-llama", "llama"))
    prompt = mx.array([(7 * i + 3) % 250 for i in range(length)])
    cache = make_prompt_cache(model)
    for start in range(0, length - 1, 32):  # mlx-lm's generate_step, prefill_step_size=32
        model(prompt[None, start : min(start + 32, length - 1)], cache=cache)
    expected = model(prompt[None, -1:], cache=cache)[0, -1]
    target = Target(model, [1])
    draft = create_random_draft(_config(model), num_layers=1, block_size=16, mask_token_id=MASK_ID)
    proposer = DFlashProposer(draft)
    ours = target.make_cache()
    proposer.start(target)
    # (chunks of 32: several, as 2048 would be for long prompts)
    assert mx.array_equal(prefill(target, proposer, prompt, ours, step=32)[0], expected).item()
    # the draft's context of the prompt (all but its last token, which a plain step's context
    # joins) is stored by the prefill, not left to the first draft pass, which is timed as decoding
    assert [c.bound for c in proposer.cache] == [length - 1]


def test_llama_block_size_10(tiny_dir):
    """The published Llama-3.1 draft drafts blocks of 10."""
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "llama-bs10", "llama", "The quick brown fox", 80)
    draft = create_random_draft(_config(model), num_layers=1, block_size=10, mask_token_id=MASK_ID)
    assert generate(model, tokenizer, prompt, draft, max_tokens=80).tokens == reference
    proposer = ReplayProposer(prompt + reference, 10, [2, None, 6, 0], VOCAB_SIZE)
    result = generate(model, tokenizer, prompt, proposer, max_tokens=80)
    assert result.tokens == reference and max(result.acceptance_lengths) == 10


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_queued_cycles_equal_greedy(tiny_dir, family):
    """What GPUs run, here on the CPU: each block queued before the previous accept count is
    read (rollback, draft context and next first token from the count on the device), keys read
    from whole buffers, blocks through a compiled forward (targets of only KV caches) with packed
    and row-by-row projections, compiled draft passes, a draft context window cut by device
    counts; tokens equal mlx-lm greedy with a random draft, planted mistakes, and the adaptive
    policy's mix of sizes."""
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / f"queued-{family}", family, "def fib(n):\n    return",
                                                    3 * MAX_TOKENS)
    assert Target(model, [1]).rolls_back_on_device
    draft = create_random_draft(_config(model), num_layers=1, block_size=16, mask_token_id=MASK_ID)
    draft.config.context_window, draft.config.context_sink = 8, 2
    result = generate(model, tokenizer, prompt, draft, max_tokens=MAX_TOKENS, options=GPU_PATHS)
    assert result.tokens == reference[:MAX_TOKENS]
    proposer = ReplayProposer(prompt + reference, 16, SCHEDULE, VOCAB_SIZE)
    for adaptive in (False, True):
        result = generate(model, tokenizer, prompt, proposer, max_tokens=3 * MAX_TOKENS - 5, options=GPU_PATHS,
                          adaptive=adaptive)
        assert result.tokens == reference[: 3 * MAX_TOKENS - 5]


@pytest.mark.parametrize("options", [EngineOptions(), GPU_PATHS], ids=["cpu-paths", "gpu-paths"])
def test_the_first_block_is_queued_behind_the_prefill(tiny_dir, options):
    """Where blocks queue ahead, the first block is in the caches before the prefill's token is
    handed over (as mlx-lm queues its second step before reading its first); elsewhere after it."""
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / "first-block", "llama", "def fib(n):\n    return",
                                                    MAX_TOKENS)
    draft = create_random_draft(_config(model), num_layers=1, block_size=8, mask_token_id=MASK_ID)
    target, proposer = make_proposer(model, draft, options)
    caches = []
    make_cache = target.make_cache
    target.make_cache = lambda: caches.append(make_cache()) or caches[-1]  # (this instance only)
    cycles = decode_cycles(target, proposer, mx.array(prompt), MAX_TOKENS, 8)
    first = next(cycles)
    queued = options is GPU_PATHS
    assert caches[0][0].offset == len(prompt) + 8 * queued
    assert first.tokens + [t for cycle in cycles for t in cycle.tokens] == reference[:MAX_TOKENS]


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_targets_with_rotating_caches_read_each_count(tiny_dir, family):
    """A rotating cache is cut by a count on the host: such targets keep mlx-lm's caches, and
    their blocks are not queued ahead."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / f"rotating-{family}", family))
    target = Target(model, [1])
    assert not target.rolls_back_on_device
    assert any(isinstance(c, RotatingKVCache) for c in target.make_cache())


# ---------------------------------------------------------------------------
# Rollback parity: verify a block then roll back == feed only the accepted tokens


def _flat_state(cache) -> list[mx.array]:
    """The arrays that hold history: KV up to the offset, the last window-1 rotating entries
    (all a later step can attend to), recurrent state."""
    if isinstance(cache, RotatingKVCache):  # the window's history, oldest first
        keys, values, _, keep, max_size, idx = cache.state
        assert keep == 0
        return [mx.concatenate([x[..., idx:, :], x[..., :idx, :]], axis=2)[..., 1 - max_size :, :]
                for x in (keys, values)]
    if isinstance(cache, KVCache):
        return [cache.keys[..., : _positions(cache), :], cache.values[..., : _positions(cache), :]]
    if isinstance(cache, QuantizedKVCache):  # dequantized keys and values
        return [mx.dequantize(*(x[..., : cache.offset, :] for x in part), group_size=cache.group_size,
                              bits=cache.bits) for part in (cache.keys, cache.values)]
    return list(cache.cache)  # ArraysCache: conv window, recurrent state


def _positions(cache):
    offset = getattr(cache, "offset", None)
    return offset.item() if isinstance(offset, mx.array) else offset


def _assert_same_caches(rolled, direct):
    for a, b in zip(rolled, direct):
        assert type(a) is type(b) and _positions(a) == _positions(b)
        for x, y in zip(_flat_state(a), _flat_state(b), strict=True):
            assert x.shape == y.shape
            # within 1e-5 of the state's scale: verifying 16 rows vs feeding `keep` rows changes
            # matmul blocking, so attention-layer keys and recurrent states (the chunked delta
            # rule, delta_rule.py) differ in the last bits; an 8-bit cache may round such a key
            # one step differently
            x, y = x.astype(mx.float32), y.astype(mx.float32)
            step = mx.abs(y).max().item() / 127 if isinstance(a, QuantizedKVCache) else 0.0
            assert mx.abs(x - y).max().item() <= 1e-5 * max(mx.abs(y).max().item(), 1.0) + step


CACHE_KINDS = {  # cache type under test -> a family whose cache list holds it (+ config overrides)
    "DeviceKVCache": ("qwen3", {}),  # ours: what a target of only KV (and recurrent) caches gets
    "KVCache": ("gemma3_text", {}),  # mlx-lm's, beside rotating caches
    "RotatingKVCache": ("gemma3_text", {}),
    "ArraysCache": ("qwen3_5", {}),
    "QuantizedKVCache": ("qwen3", {"head_dim": 32}),  # quantization groups of 32 along head_dim
}
ON_DEVICE = {"DeviceKVCache", "ArraysCache"}  # can be cut by a count the host has not read


# (a count on the device keeps at least the block's first token: the engine's only case)
@pytest.mark.parametrize("kind, count_on_device, keep",
                         [(k, False, keep) for k in CACHE_KINDS for keep in (0, 1, 2, 7, 15)]
                         + [(k, True, keep) for k in sorted(ON_DEVICE) for keep in (1, 2, 7, 15)])
def test_rollback_parity(tiny_dir, kind, count_on_device, keep):
    family, overrides = CACHE_KINDS[kind]
    model, _ = load_tiny(make_tiny_target(tiny_dir / f"parity-{kind}", family, **overrides))
    target = Target(model, [1])
    prompt = mx.array([[(7 * i) % 250 for i in range(21)]])  # longer than the sliding window (8)
    block = mx.array([[(11 * i + 3) % 250 for i in range(16)]])

    def prefilled():
        cache = target.make_cache()
        if kind == "QuantizedKVCache":
            cache = [QuantizedKVCache(group_size=32, bits=8) for _ in cache]
        target(prompt, cache)
        return cache

    rolled, direct = prefilled(), prefilled()
    target(block, rolled)
    target.rollback(rolled, mx.array(16 - keep) if count_on_device else 16 - keep)
    if keep:
        target(block[:, :keep], direct)
    assert any(type(c).__name__ == kind for c in rolled)
    _assert_same_caches(rolled, direct)
    # and both continue alike (an 8-bit cache's one-step rounding differences reach the logits;
    # recurrent states that differ by ~1e-7 move these logits, scale ~10, by up to ~3e-4 with
    # OpenBLAS; a wrong prefix moves them by whole units)
    nxt = mx.array([[42, 43, 44]])
    gap = mx.abs(target(nxt, rolled)[0] - target(nxt, direct)[0]).max().item()
    assert gap <= {"QuantizedKVCache": 2e-2, "ArraysCache": 1e-3}.get(kind, 1e-4), gap


@pytest.mark.parametrize("compiled", [False, True])
def test_a_device_count_cuts_all_layers_offsets_once(tiny_dir, compiled):
    """Layers move in step: a rollback by a count on the device gives every layer one offset
    array, not an op a layer (each a kernel launch on a GPU), and the caches stay right."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / "shared-cut-qwen3", "qwen3"))
    target = Target(model, [1], EngineOptions(compile_blocks=compiled))
    prompt = mx.array([[(7 * i) % 250 for i in range(21)]])
    block = mx.array([[(11 * i + 3) % 250 for i in range(16)]])
    rolled, direct = target.make_cache(), target.make_cache()
    target(prompt, rolled), target(prompt, direct)
    for keep in (7, 3):  # the second cut from device offsets: a compiled block leaves one for all
        target(block, rolled)  # layers (what GPUs run); an eager one, one a layer (no count shared)
        target.rollback(rolled, mx.array(16 - keep))
        shared = all(c.offset is rolled[0].offset for c in rolled)
        assert len(rolled) > 1 and shared == (compiled or keep == 7)
        target(block[:, :keep], direct)
    assert rolled[0].offset.item() == direct[0].offset == 21 + 7 + 3
    nxt = mx.array([[42, 43, 44]])
    assert mx.abs(target(nxt, rolled)[0] - target(nxt, direct)[0]).max().item() <= 1e-4


@pytest.mark.parametrize("family, stepwise", [("llama", None), ("qwen3", None), ("qwen3_moe", None),
                                              ("qwen3_5", False), ("qwen3_5", True), ("qwen3_5_moe", True),
                                              ("qwen3_next", False)])
def test_compiled_blocks_equal_eager_ones(tiny_dir, family, stepwise):
    """A block through the compiled forward (whole buffers in and out; a hybrid's recurrent
    states and what its mixers keep for a rewind, both forms of the delta rule) gives the eager
    forward's logits, features and caches, after rollbacks by a count on the device and on the
    host, and across a buffer's growth (prompt 250 + blocks: past 256 positions); projections
    packed and row by row, as on GPUs."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / f"compiled-{family}", family))
    targets = {compiled: Target(model, [0, 1], EngineOptions(compile_blocks=compiled, rowwise_products=True))
               for compiled in (True, False)}
    for mixer in targets[True]._block_mixers.values():  # (one mixer a layer, shared by both)
        mixer.stepwise = stepwise
    prompt = mx.array([[(7 * i) % 250 for i in range(250)]])
    blocks = [mx.array([[(11 * i + j) % 250 for i in range(16)]]) for j in range(3)]
    caches = {}
    for compiled, target in targets.items():
        cache = target.make_cache()
        attention = [c for c in cache if isinstance(c, KVCache)]
        target(prompt, cache)
        outputs = []
        for j, block in enumerate(blocks):
            outputs.append(target(block, cache))
            if j == 0:  # a count read on the host (sampling): the length stays exact on the host
                target.rollback(cache, 16 - 5)
                assert all(isinstance(c.offset, int) and c.offset == c.bound for c in attention)
            else:  # a count on the device (queued greedy cycles), then read
                target.rollback(cache, mx.array(16 - 5))
                target.settle(cache, attention[0].bound - 16 + 5)
        caches[compiled] = (outputs, cache)
    (compiled_out, compiled_cache), (eager_out, eager_cache) = caches[True], caches[False]
    assert targets[True].recorder.block_forwards
    tolerance = reordering_bound(_config(model))
    for ours, reference in zip(compiled_out, eager_out):
        for x, y in zip(ours, reference):
            assert mx.abs(x - y).max().item() <= tolerance * mx.abs(y).max().item()
    for a, b in zip(compiled_cache, eager_cache):
        if isinstance(a, KVCache):
            assert _positions(a) == _positions(b) == 250 + 3 * 5
        for x, y in zip(_flat_state(a), _flat_state(b), strict=True):
            assert mx.abs(x - y).max().item() <= tolerance * max(mx.abs(y).max().item(), 1.0)


def reordering_bound(config: dict) -> float:
    """How far two float32 forwards that sum their products in different orders (packed or
    row-by-row products, fused ops, whichever kernels the BLAS picks for the CPU) may differ,
    relative to the output's scale. One dot product of length n rounds within gamma_n ~ n*u of
    its terms' magnitudes (u = 2**-24), so two orders differ by up to 2*n*u; to first order
    those errors add over the layers and the head. A real defect (a wrong mask, cache or
    offset) moves outputs by O(1) of their scale, far above this."""
    n = max(config["hidden_size"], config["intermediate_size"])  # the longest reduction
    return 2 * n * 2.0**-24 * (config["num_hidden_layers"] + 1)


def test_cpu_compiles_short_blocks_only(tiny_dir, monkeypatch):
    """By default the CPU compiles blocks up to CPU_COMPILED_BLOCK tokens (longer ones measured
    slower compiled there), GPUs every block; True and False force every block or none."""
    from mlx_dflash import options as options_module

    model, _ = load_tiny(make_tiny_target(tiny_dir / "compiles-llama", "llama"))

    def compiles(n: int, **chosen) -> bool:
        target = Target(model, [0, 1], EngineOptions(**chosen))
        cache = target.make_cache()
        target(mx.array([[(7 * i) % 250 for i in range(40)]]), cache)
        return target._compiles(mx.zeros((1, n), dtype=mx.uint32), cache)

    short, long = options_module.CPU_COMPILED_BLOCK, options_module.CPU_COMPILED_BLOCK + 1
    assert (compiles(1), compiles(short), compiles(long)) == (False, True, False)
    monkeypatch.setattr(options_module, "on_gpu", lambda: True)
    assert EngineOptions().longest_compiled_block(64) == 64
    for forced in (True, False):
        assert (compiles(short, compile_blocks=forced), compiles(16, compile_blocks=forced)) == (forced, forced)


@pytest.mark.parametrize("family, bits, rowwise", [("llama", None, True), ("qwen2", None, True),
                                                   ("qwen3_moe", None, True), ("qwen3_5", None, False),
                                                   ("qwen3", 4, True), ("qwen3", 8, False)])
def test_block_projections_equal_the_models_own(tiny_dir, family, bits, rowwise):
    """q/k/v and gate/up packed into one matmul each (qwen2: with biases; quantized alike), the
    other plain projections and a tied head row by row: installed, they give the model's own
    outputs; outside, the model is mlx-lm's again."""
    from mlx_dflash.projections import BlockProjections, PackedProjection, RowwiseProjection

    path = make_tiny_target(tiny_dir / f"packed-{family}", family)
    model, _ = load_tiny(path)
    reference, _ = load_tiny(path)
    if bits:
        nn.quantize(model, group_size=32, bits=bits), nn.quantize(reference, group_size=32, bits=bits)
    projections = BlockProjections(model, pack=True, rowwise=rowwise)
    packed = [s for s in projections.swaps if isinstance(s[3], PackedProjection)]
    assert len(packed) >= 2 * len(model.layers)  # gate/up everywhere, q/k/v in attention layers
    if family == "qwen3_5":  # and a Gated DeltaNet mixer's four input projections
        assert {s[1] for s in packed} >= {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"}
    assert any(isinstance(s[3], RowwiseProjection) for s in projections.swaps) == (rowwise and not bits)
    block, step = mx.array([[(7 * i) % 250 for i in range(21)]]), mx.array([[42]])
    expected = reference(block)
    with projections.installed():
        assert any(isinstance(m, PackedProjection) for m in model.modules())
        gap = mx.abs(model(block) - expected).max().item() / mx.abs(expected).max().item()
    assert gap <= 1e-5, gap  # (one matmul's blocking instead of another's: the last bits differ)
    assert not any(isinstance(m, (PackedProjection, RowwiseProjection)) for m in model.modules())
    assert not any("as_linear" in vars(m) for m in model.modules())
    assert mx.array_equal(model(block), expected).item() and mx.array_equal(model(step), reference(step)).item()


def test_block_projections_of_one_model_share_its_packed_layers(tiny_dir):
    """A second set of block projections (another row-by-row choice: a batch's beside one
    sequence's) reuses the layers the first packed, the members' weights left as they are (packing
    again would keep a second copy); both give the model's own outputs."""
    from mlx_dflash.projections import block_projections

    path = make_tiny_target(tiny_dir / "packed-shared", "qwen3")
    model, _ = load_tiny(path)
    reference, _ = load_tiny(path)
    packed: dict = {}
    one = block_projections(model, rowwise=True, packed=packed)
    q_proj = model.layers[0].self_attn.q_proj
    weight, layers = q_proj.weight, dict(packed)
    other = block_projections(model, rowwise=False, packed=packed)
    assert q_proj.weight is weight and packed == layers and len(packed) == 2 * len(model.layers)
    assert {id(s[3].group.packed) for s in one.swaps if hasattr(s[3], "group")} == {
        id(s[3].group.packed) for s in other.swaps if hasattr(s[3], "group")}
    block = mx.array([[(7 * i) % 250 for i in range(21)]])
    expected = reference(block)
    for projections in (one, other):
        with projections.installed():
            gap = mx.abs(model(block) - expected).max().item() / mx.abs(expected).max().item()
        assert gap <= 1e-5, gap
    assert block_projections(model, rowwise=False).swaps and q_proj.weight is not weight  # (unshared: packed again)


def test_row_by_row_by_default_only_on_gpus_and_for_small_models(tiny_dir, monkeypatch):
    """Row by row, a block reads each weight once per row: by default only a GPU runs it, and only
    for a model of at most ROWWISE_MAX_BYTES of plain weights (a larger verify would turn
    bandwidth-bound)."""
    from mlx_dflash import projections

    model, _ = load_tiny(make_tiny_target(tiny_dir / "rowwise-size", "llama"))
    size = projections.plain_weight_bytes(model)
    assert size == sum(p.nbytes for _, p in nn.utils.tree_flatten(model.parameters()) if p.ndim == 2)

    def runs_row_by_row() -> bool:
        return bool(projections.block_projections(model).embeddings)  # (the tied head: row by row)

    assert not runs_row_by_row()  # the CPU
    monkeypatch.setattr(projections, "on_gpu", lambda: True)
    assert runs_row_by_row()
    monkeypatch.setattr(projections, "ROWWISE_MAX_BYTES", size - 1)
    assert not runs_row_by_row()
    assert projections.block_projections(model, rowwise=True).embeddings


def test_the_default_pairs_float32_target_runs_row_by_row_on_gpus(monkeypatch):
    """SmolLM2-135M in float32 (513 MiB of plain weights) verifies row by row on GPUs, faster
    than with cuBLAS (docs/performance.md). Built lazily from its config: nothing is evaluated,
    only sizes are read."""
    from mlx_lm.models import llama

    from mlx_dflash import projections

    args = llama.ModelArgs(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                           num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=49152,
                           tie_word_embeddings=True)  # SmolLM2-135M-Instruct's config
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    assert projections.plain_weight_bytes(model) == 537_919_488
    monkeypatch.setattr(projections, "on_gpu", lambda: True)
    assert projections.block_projections(model, pack=False).embeddings  # (the tied head: row by row; packing
    # would evaluate the weights)


def test_rowwise_product_is_each_rows_own_product():
    """``W @ x[..., None]`` asks for the products ``x @ W.T`` does, one row at a time."""
    from mlx_dflash.projections import rowwise_product

    weight, x = mx.random.normal((48, 64)), mx.random.normal((2, 16, 64))
    rows = rowwise_product(x, weight)
    assert rows.shape == (2, 16, 48)
    assert mx.allclose(rows, x @ weight.T, atol=1e-4).item()
    assert mx.allclose(rows[1, 5], (x[1, 5:6] @ weight.T)[0], atol=1e-5).item()


def test_exact_settle_gives_plain_steps_mlx_lms_path(tiny_dir):
    """After a block cut by a count on the device and a plain step queued behind it, the host
    knows the exact length: the offset is an int again and single tokens need no mask."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / "settle-qwen3", "qwen3"))
    target = Target(model, [1])
    prompt = mx.array([[(7 * i) % 250 for i in range(21)]])
    block = mx.array([[(11 * i + 3) % 250 for i in range(16)]])
    step, nxt = mx.array([[42]]), mx.array([[43]])
    queued, direct = target.make_cache(), target.make_cache()
    target(prompt, queued), target(prompt, direct)
    target(block, queued)
    target.rollback(queued, mx.array(16 - 7))
    target(step, queued)
    assert not isinstance(queued[0].offset, int)
    target.settle(queued, 21 + 7 + 1, exact=True)
    assert all(c.offset == c.bound == 29 and isinstance(c.offset, int) for c in queued)
    assert queued[0].make_mask(1) is None  # mlx-lm's one-query attention, no mask
    target(block[:, :7], direct), target(step, direct)
    gap = mx.abs(target(nxt, queued)[0] - target(nxt, direct)[0]).max().item()
    assert gap <= 1e-4, gap


# ---------------------------------------------------------------------------
# Quantized targets and drafts


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantized_target_equals_its_own_greedy(tiny_dir, bits, group_size):
    path = make_tiny_target(tiny_dir / "quant-qwen3", "qwen3", hidden_size=128, head_dim=32)  # groups of 128 fit
    model, tokenizer = load_tiny(path)
    tokenizer.eos_token_ids = set()
    nn.quantize(model, group_size=group_size, bits=bits)
    prompt = tokenizer.encode("def add(a, b):")
    reference = greedy_reference(model, prompt, 48)
    draft = create_random_draft(_config(model), num_layers=1, block_size=16, mask_token_id=MASK_ID)
    quantize_draft(draft, bits, group_size)
    assert generate(model, tokenizer, prompt, draft, max_tokens=48).tokens == reference
    proposer = ReplayProposer(prompt + reference, 16, SCHEDULE, VOCAB_SIZE)
    assert generate(model, tokenizer, prompt, proposer, max_tokens=48).tokens == reference


def test_unsupported_family_fails_at_load_naming_it(tiny_dir):
    import importlib

    module = importlib.import_module("mlx_lm.models.mamba")
    args = module.ModelArgs(model_type="mamba", vocab_size=32, hidden_size=16, intermediate_size=32,
                            state_size=4, num_hidden_layers=2, conv_kernel=4, use_bias=False,
                            use_conv_bias=True, time_step_rank=4)
    with pytest.raises(DFlashError, match="'mamba' is not supported"):
        Target(module.Model(args), [0])


def test_gemma_draft_sees_scaled_embeddings(tiny_dir):
    """The draft's block embeddings match what Gemma's first layer receives."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / "family-gemma-embed", "gemma3_text"))
    target = Target(model, [1])
    ids = mx.array([[3, 5, 7]])
    raw = model.model.embed_tokens(ids)
    assert mx.allclose(target.embed(ids), raw * 64**0.5, rtol=1e-2).item()
    assert not mx.allclose(target.embed(ids), raw).item()
