"""The target model seen by the engine: logits plus the hidden states the draft needs.

We do not re-implement any model's forward. Instead the chosen decoder layers of
ONE model instance are wrapped (``TappedLayer``) so that the model's own
``__call__`` -- masks, sliding windows, softcapping and all -- runs unchanged
while the wrapped layers record their outputs. No mlx-lm class is patched.

Rollback after a partially accepted block follows the cache type of each
layer (``rollback.py``); the recurrent layers of hybrid families (Gated DeltaNet)
get their token mixer wrapped (``delta_rule.py``) so that a verified block can be
rewound to any prefix.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import gather_last_axis
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from .cpu_kernels import block_kernels, rope_at_depths
from .delta_rule import BlockDeltaMixer
from .distributed import check_shardable, pipeline_stages, shard, sharding_group
from .draft import DFlashDraft
from .errors import DFlashError
from .options import DEFAULT_OPTIONS, EngineOptions
from .projections import block_projections, swapped
from .rollback import (PADDED_BLOCK, BufferView, DeviceKVCache, cache_arrays, device_count, is_recurrent, keep_path,
                       recurrent_view, trim_attention_cache, unsupported_cache)
from .tree import DeviceTree, DraftTree, tree_mask

# Families tested end to end against mlx-lm greedy (tests/test_families.py). Others fail
# at load time: a family we have not checked could hide a cache we cannot roll back.
SUPPORTED_FAMILIES = {
    "llama", "qwen2", "qwen3",  # dense attention
    "qwen3_moe",  # mixture of experts
    "gemma3_text", "gpt_oss",  # sliding-window layers (rotating caches), gpt-oss attention sinks
    "qwen3_5", "qwen3_5_moe", "qwen3_next",  # hybrid: Gated DeltaNet + attention
}
SCALED_EMBEDDINGS = {"gemma3_text"}  # the model multiplies embeddings by sqrt(hidden_size)

class _Recorder:
    """Where tapped layers put their outputs; only records while ``active``. Shared by the
    Targets of one model with the same taps, and so are their compiled block forwards (one per
    set of projection options)."""

    def __init__(self) -> None:
        self.active = False
        self.outputs: dict[int, mx.array] = {}
        self.block_forwards: dict[tuple, Callable] = {}
        self.packed_layers: dict = {}  # the model's packed projections, shared by its block forwards
        self.traces = 0  # times a compiled block forward was traced (once per new shape: costly on GPUs)


class TappedLayer(nn.Module):
    """Wraps one decoder layer instance; records its output (a draft feature)."""

    def __init__(self, layer: nn.Module, index: int, recorder: _Recorder):
        super().__init__()
        self.layer = layer
        self.index = index
        self.recorder = recorder  # a plain object, so not part of the parameters

    def __call__(self, x, *args, **kwargs):
        out = self.layer(x, *args, **kwargs)
        if self.recorder.active:
            self.recorder.outputs[self.index] = out
        return out

    def __getattr__(self, name: str) -> Any:
        # Model forwards read attributes of their layers (e.g. llama's ``use_sliding``).
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)


class TreeRope(nn.Module):
    """A layer's RoPE during a tree's verify: each node at the block's start plus its depth
    (one call: the nodes become the batch, each with its own offset). With the depths known to
    the host (an eager verify), on the CPU the rows of ``cpu_kernels``' shared tables instead:
    the same numbers, without rebuilding the tables in every layer."""

    def __init__(self, rope: nn.Module, depths: mx.array, known: Optional[list[int]] = None):
        super().__init__()
        self.rotate = rope.__call__  # (a plain attribute: the module stays its parent's)
        self.depths, self.known = depths, known

    def __call__(self, x: mx.array, offset: Union[int, mx.array] = 0) -> mx.array:
        if self.known is not None:
            rotated = rope_at_depths(self.rotate.__self__, x, offset, self.known)
            if rotated is not None:
                return rotated
        return self.rotate(x.swapaxes(0, 2), offset=offset + self.depths).swapaxes(0, 2)


class TreeMaskedCache:
    """A layer's cache during a tree's verify: the cache itself, with the tree's mask."""

    def __init__(self, cache: Any, tree: DraftTree):
        self._cache, self._tree = cache, tree

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        sequential = self._cache.make_mask(N, return_array=True, window_size=window_size)
        if isinstance(self._cache, RotatingKVCache):  # (its block goes after the window it keeps)
            return tree_mask(self._tree, sequential, sequential.shape[-1] - N, window_size or self._cache.max_size)
        return tree_mask(self._tree, sequential, self._cache.offset, window_size)


def _model_type(model: nn.Module) -> str:
    return getattr(model, "model_type", None) or getattr(model.args, "model_type", "?")


def text_args(model: nn.Module):
    """The language model's arguments (a VLM wrapper such as Qwen3.5 keeps them inside)."""
    return getattr(model, "language_model", model).args


class Target:
    """An mlx-lm model with taps on ``layer_ids``; ``__call__`` returns (logits, features)."""

    def __init__(self, model: nn.Module, layer_ids: list[int], options: EngineOptions = DEFAULT_OPTIONS):
        family = _model_type(model)
        if family not in SUPPORTED_FAMILIES:
            supported = ", ".join(sorted(SUPPORTED_FAMILIES))
            raise DFlashError(f"target family {family!r} is not supported yet (supported: {supported})")
        self.model = model
        self.options = options.resolved()
        self.text_model = getattr(model, "language_model", model)  # VLM wrappers keep the LM inside
        self.family = family
        self.layer_ids = list(layer_ids)
        caches = make_prompt_cache(model)
        odd = sorted({type(c).__name__ for c in caches if unsupported_cache(c)})
        if odd:
            raise DFlashError(f"{family} uses caches mlx-dflash cannot roll back: {', '.join(odd)}")
        self.recurrent_ids = [i for i, c in enumerate(caches) if is_recurrent(c)]
        # Every layer can be cut by a count still on the device (plain KV caches and recurrent
        # layers): the engine then queues a cycle before it reads the previous one's count.
        self.rolls_back_on_device = all(type(c) is KVCache or is_recurrent(c) for c in caches)
        # Trees (tree.py) need attention caches whose keys can be moved together after the walk.
        self.verifies_trees = all(type(c) in (KVCache, RotatingKVCache) for c in caches)
        self.group = sharding_group(model)  # the processes it is sharded over (distributed.py), or None
        self.pipelined = pipeline_stages(model) > 1  # each process runs some of the layers
        self.recorder = _Recorder()
        self._latest_length = 0  # tokens of the latest call: what a rollback cuts from
        self._install_taps()
        self._block_mixers = self._install_block_mixers()  # recurrent layer index -> its mixer
        self._block_kernels = block_kernels(model, float_dtype(model))  # CPU: attention, SwiGLU, RoPE; CUDA: attention

    # -- structure -------------------------------------------------------
    @property
    def args(self):
        return text_args(self.model)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def _layer_list(self) -> list:
        """The stored list of decoder layers, indexed by layer number (``model.layers`` may be a
        fresh slice of it; a pipeline stage's list holds None before its first layer and ends
        after its last)."""
        inner = getattr(self.model, "model", None)
        return inner.layers if isinstance(getattr(inner, "layers", None), list) else self.model.layers

    def _install_taps(self) -> None:
        layers = self._layer_list()
        total = self.args.num_hidden_layers
        for i in self.layer_ids:
            if not 0 <= i < total:
                raise DFlashError(f"target layer id {i} is out of range (target has {total} layers)")
        tapped = {i: layer for i, layer in enumerate(layers) if isinstance(layer, TappedLayer)}
        ours = {i for i in self.layer_ids if i < len(layers) and layers[i] is not None}  # (this stage's)
        if tapped and set(tapped) == ours:
            self.recorder = next(iter(tapped.values())).recorder  # same taps already in place: share them
            return
        for i, layer in tapped.items():  # different taps of an earlier Target: undo them
            layers[i] = layer.layer
        for i in ours:  # (a shallow target may be tapped twice at one layer)
            layers[i] = TappedLayer(layers[i], i, self.recorder)
        if sum(isinstance(layer, TappedLayer) for layer in self.model.layers) != len(ours):
            raise DFlashError(f"cannot tap layers of a {self.family} model: its layer list is not mutable")

    def _decoder_layer(self, i: int) -> nn.Module:
        """The layer of cache entry ``i`` (this process's ``i``-th layer), under its tap if it has one."""
        layer = self.model.layers[i]
        return layer.layer if isinstance(layer, TappedLayer) else layer

    def _install_block_mixers(self) -> dict[int, BlockDeltaMixer]:
        """Wrap the token mixer of each recurrent layer (once per model instance)."""
        for i in self.recurrent_ids:
            layer = self._decoder_layer(i)
            mixer = getattr(layer, "linear_attn", None)
            if isinstance(mixer, BlockDeltaMixer):
                continue
            if mixer is None or not hasattr(mixer, "conv1d"):
                raise DFlashError(f"{self.family} layer {i} has a recurrent cache but no Gated DeltaNet mixer")
            layer.linear_attn = BlockDeltaMixer(mixer)
        return {i: self._decoder_layer(i).linear_attn for i in self.recurrent_ids}

    # -- pieces the draft borrows -----------------------------------------
    def embed(self, tokens: mx.array) -> mx.array:
        """Token embeddings at the scale the target's first layer sees them (Gemma scales by
        sqrt(hidden), rounded through bfloat16 as mlx-lm does)."""
        h = self.model.model.embed_tokens(tokens)
        if self.family in SCALED_EMBEDDINGS:
            h = h * mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        return h

    def _output_layer(self) -> tuple[nn.Module, bool]:
        """(the output projection, whether it is the tied input embedding)."""
        if getattr(self.args, "tie_word_embeddings", False) or not hasattr(self.text_model, "lm_head"):
            return self.model.model.embed_tokens, True
        return self.text_model.lm_head, False

    def head(self, hidden: mx.array) -> mx.array:
        """Logits from final-normed hidden states (tied or untied output head; a head sharded
        over the vocabulary gathered whole, as the model's own forward does)."""
        layer, tied = self._output_layer()
        if tied:
            return layer.as_linear(hidden)
        group = getattr(self.text_model, "sharding_group", None)
        return layer(hidden) if group is None else gather_last_axis(layer(hidden), group)

    def head_rows(self, token_ids: mx.array) -> Callable[[mx.array], mx.array]:
        """The head restricted to ``token_ids``: column j of its logits is ``head``'s column
        ``token_ids[j]``. A copy of the output layer (plain or quantized) with only those
        rows: a draft proposes from a few thousand frequent tokens, and the full 49k-248k-way
        head is most of a small draft's pass."""
        layer, tied = self._output_layer()
        if not tied and getattr(self.text_model, "sharding_group", None) is not None:
            return lambda hidden: self.head(hidden)[..., token_ids]  # (each process holds other rows)
        rows = copy.copy(layer)
        for name in ("weight", "scales", "biases", "bias"):
            if name in layer:
                rows[name] = layer[name][token_ids]
        mx.eval(rows.parameters())
        return rows.as_linear if tied else rows

    # -- forward and cache ----------------------------------------------
    def make_cache(self) -> list[Any]:
        caches = make_prompt_cache(self.model)
        if self.rolls_back_on_device:
            caches = [DeviceKVCache(self.options.pad_reads) if type(c) is KVCache else c for c in caches]
        return caches

    def __call__(self, tokens: mx.array, cache: Optional[list[Any]], prompt: bool = False, eager: bool = False
                 ) -> tuple[mx.array, mx.array]:
        """Logits [B, L, V] and tapped features [B, L, K*H] (in ``layer_ids`` order); ``cache``
        None: whole sequences without one (training). ``prompt``: a chunk of the prompt, run as
        mlx-lm runs it (never a compiled block, whose packed products and fused ops differ in
        their last bits: the first token must be mlx-lm's). ``eager``: a block never compiled
        (a shape seen once, whose trace would cost more than it saves)."""
        self._latest_length = tokens.shape[1]
        if not prompt and not eager and self._compiles(tokens, cache):
            logits, features = self._compiled_block(tokens, cache)
        else:
            logits, features = self._forward(tokens, cache, block=not prompt and tokens.shape[1] > 1)
        if self.pipelined:
            # Queue the stages' hand-over and sums now, in the order every process builds them: a
            # later graph could otherwise reach them after a receive that waits on the other process.
            mx.async_eval(logits, features)
        return logits, features

    def _compiles(self, tokens: mx.array, cache: Optional[list[Any]], tree: bool = False) -> bool:
        """Whether this block (or ``tree``: trees compile where the longest blocks do) runs compiled."""
        longest = self.options.longest_compiled_block(PADDED_BLOCK)
        return ((1 < tokens.shape[1] <= longest or tree and longest == PADDED_BLOCK) and cache is not None
                and all(c.keys is not None if isinstance(c, DeviceKVCache) else is_recurrent(c) and not c.empty()
                        for c in cache))

    def _compiled_block(self, tokens: mx.array, cache: list[Any], tree: Optional[tuple[mx.array, mx.array]] = None
                        ) -> tuple[mx.array, mx.array]:
        """The forward of a block under mx.compile, each cache's arrays as inputs and outputs
        (a key/value cache's whole buffer, ``rollback.BufferView``; a recurrent layer's conv
        window and state, and what its mixer keeps for a rewind); traced again only when a shape
        changes. Hybrids (Qwen3.5, Qwen3-Next) compile too: their verify is host-bound on GPUs
        (many small ops a Gated DeltaNet layer), and the trace is replayed faster than it is built.
        A tree's verify (``verify_tree``) takes its nodes' depths and ancestors (``tree``) as inputs too."""
        mixers = self._block_mixers
        # Row by row only for one sequence: a batch's rows would read every weight once per row of each.
        rowwise = self.options.rowwise_products if tokens.shape[0] == 1 else False
        key = (self.options.pack_projections, rowwise, tree is not None)
        if key not in self.recorder.block_forwards:
            projections = block_projections(self.model, *key[:2], packed=self.recorder.packed_layers)  # (projections.py)

            def forward(tokens: mx.array, offset: mx.array, depths: mx.array, ancestors: mx.array, *arrays: mx.array):
                self.recorder.traces += 1  # (the body runs only while mx.compile traces it)
                views = [recurrent_view(*arrays[j : j + 2]) if i in mixers
                         else BufferView(*arrays[j : j + 2], offset, ancestors if tree is not None else None)
                         for i, j in enumerate(range(0, len(arrays), 2))]
                within = self._tree_ropes(depths) if tree is not None else nullcontext()
                with projections.installed():
                    logits, features = self._forward(tokens, views, block=True, within=within)
                return (logits, features, *(x for view in views for x in cache_arrays(view)),
                        *(x for i, mixer in mixers.items() for x in mixer.block_arrays(views[i])))
            self.recorder.block_forwards[key] = mx.compile(forward)
        n = tokens.shape[1]
        attention = [c for c in cache if isinstance(c, DeviceKVCache)]
        for layer_cache in attention:
            layer_cache.make_room(n)
        start = attention[0].offset if attention else 0  # (every layer is at the same position)
        logits, features, *arrays = self.recorder.block_forwards[key](
            tokens, device_count(start), *(tree or (mx.array(0), mx.array(0))),
            *(x for layer_cache in cache for x in cache_arrays(layer_cache)))
        layer_arrays, kept = arrays[: 2 * len(cache)], iter(arrays[2 * len(cache) :])
        per_mixer = (len(arrays) - 2 * len(cache)) // max(len(mixers), 1)
        end = start + n  # an int stays an int: the host keeps knowing the exact length
        for i, (layer_cache, a, b) in enumerate(zip(cache, layer_arrays[::2], layer_arrays[1::2])):
            if i in mixers:  # (in layer order, as the forward returned their arrays)
                mixers[i].took_block(layer_cache, list(layer_cache.cache), [next(kept) for _ in range(per_mixer)])
                layer_cache.cache = [a, b]
            else:
                layer_cache.wrote(a, b, n, end)
        return logits, features

    def verify_tree(self, tree: DraftTree, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """Logits and features of a tree's nodes [1, size, ...] (``tree.py``), in one forward of
        the model's own code: its RoPE modules at the nodes' positions, its caches with the
        tree's mask. Caches hold the nodes after it, for ``keep_path``."""
        self._latest_length = tree.size
        tokens = mx.array(tree.tokens, dtype=mx.uint32)[None]
        if self._compiles(tokens, cache, tree=True):
            return self._compiled_block(tokens, cache, (mx.array(tree.depths), mx.array(tree.ancestors())))
        within = self._tree_ropes(mx.array(tree.depths), tree.depths)
        return self._forward(tokens, [TreeMaskedCache(c, tree) for c in cache], block=True, within=within)

    @property
    def builds_trees_on_device(self) -> bool:
        """Whether a tree can be verified and its kept nodes moved without a host read
        (``verify_device_tree``, ``move_path``): plain key/value caches, compiled trees
        (``EngineOptions.device_trees``)."""
        return (self.options.device_trees and self.verifies_trees and self.rolls_back_on_device
                and self.options.longest_compiled_block(PADDED_BLOCK) == PADDED_BLOCK)

    def verify_device_tree(self, tree: DeviceTree, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """``verify_tree`` for a tree built on the device (``tree.device_tree``)."""
        self._latest_length = tree.size
        return self._compiled_block(tree.tokens[None], cache, (tree.depths, tree.ancestors))

    def move_path(self, cache: list[Any], order: mx.array, kept: int) -> None:
        """After ``verify_device_tree``: the tree's nodes in ``order`` (the accepted path first,
        on the device: ``DeviceTree.walk``), of which the first ``kept`` (at most that many are
        accepted) are moved to where the tree began; a rollback then drops the rest."""
        start = device_count(cache[0].offset - self._latest_length)  # (every layer is at the same position)
        rows = start + order[:kept]
        for layer_cache in cache:
            layer_cache.move(rows, start)

    def _tree_ropes(self, depths: mx.array, known: Optional[list[int]] = None) -> AbstractContextManager:
        """The model's RoPE modules at the block's start plus ``depths`` (``TreeRope``; ``known``:
        the same depths on the host)."""
        return swapped([(parent, "rope", parent.rope, TreeRope(parent.rope, depths, known)) for parent in self._rope_parents])

    @functools.cached_property
    def _rope_parents(self) -> list[nn.Module]:
        """The modules that hold the model's RoPE modules, found once (a walk of every module costs
        a host tree's cycle milliseconds)."""
        return [module for layer in self.model.layers for module in layer.modules() if "rope" in module.children()]

    def keep_path(self, cache: list[Any], path: list[int], tree_size: int) -> None:
        """After ``verify_tree``: keep the accepted nodes (``path``, from the root), moved to
        consecutive positions; drop the others."""
        for layer_cache in cache:
            keep_path(layer_cache, path, tree_size)

    def _forward(self, tokens: mx.array, cache: list[Any], block: bool = False,
                 within: AbstractContextManager = nullcontext()) -> tuple[mx.array, mx.array]:
        """The model's own forward, recording the taps; on the CPU in float32 with
        ``cpu_kernels``' RoPE tables, and a ``block`` (a verify) with its attention and SwiGLU;
        on CUDA a ``block`` with ``cuda_attention``; ``within`` a context of the caller's (inside those)."""
        self.recorder.active = True
        try:
            with self._kernels(block), within:
                logits = self.model(tokens, cache=cache)
            if self.pipelined:
                features = self._features_from_every_stage(logits)
            else:
                tapped = [self.recorder.outputs[i] for i in self.layer_ids]
                features = mx.concatenate(tapped, axis=-1) if tapped else mx.zeros((*tokens.shape, 0))
        finally:
            self.recorder.active = False
            self.recorder.outputs = {}
        return logits, features

    def _features_from_every_stage(self, logits: mx.array) -> mx.array:
        """A pipeline stage recorded its own layers' taps only: zeros stand for the others', and
        a sum over the processes fills every tap in (exact: one term is not zero). The sum
        waits for the logits, so every stage reaches it after the hand-over between stages."""
        shape, dtype = (*logits.shape[:2], self.args.hidden_size), float_dtype(self.model)
        tapped = [self.recorder.outputs.get(i, mx.zeros(shape, dtype)) for i in self.layer_ids]
        features = mx.depends(mx.concatenate(tapped, axis=-1), logits)
        return mx.distributed.all_sum(features, group=self.group)

    def _kernels(self, block: bool) -> Any:
        if self._block_kernels is None:
            return nullcontext()
        # (steps and prompts: RoPE from shared tables alone, mlx-lm's numbers bit for bit)
        return self._block_kernels.installed() if block else self._block_kernels.exact()

    def rollback(self, cache: list[Any], num_tokens: Union[int, mx.array]) -> None:
        """Drop the last ``num_tokens`` positions (rejected draft tokens) of the latest call;
        with ``rolls_back_on_device``, ``num_tokens`` may be a count the host has not read."""
        if isinstance(num_tokens, int) and num_tokens == 0:
            return
        memo: dict = {}  # (layers at one offset get one cut offset: ``rollback.shared_count``)
        keep = self._latest_length - num_tokens if self._block_mixers else None  # (one count for all of them)
        for i, layer_cache in enumerate(cache):
            if i in self._block_mixers:
                self._block_mixers[i].rewind(layer_cache, keep, memo)
            else:
                trim_attention_cache(layer_cache, num_tokens, memo)

    def settle(self, cache: list[Any], in_use: int, exact: bool = False) -> None:
        """The host has read the counts: at most ``in_use`` positions are in use (the
        committed tokens plus a block queued since; ``exact``: that many, as when the queued
        block is a plain step, which keeps its token), so attention reads no further."""
        for layer_cache in cache:
            if isinstance(layer_cache, DeviceKVCache):
                layer_cache.settle(in_use, exact)


def context_length(model: nn.Module) -> Optional[int]:
    """The most tokens (prompt and output) the model was made for, where its config says."""
    return getattr(text_args(model), "max_position_embeddings", None)


def float_dtype(model: nn.Module):
    """The dtype the draft should run in next to ``model``: its embedding's float dtype
    (float32 on the CPU, where bfloat16 bypasses BLAS); a quantized one's scale dtype."""
    embed = model.model.embed_tokens
    return embed.scales.dtype if hasattr(embed, "scales") else embed.weight.dtype


def check_compatible(draft: DFlashDraft, target: nn.Module) -> None:
    """Fail with one clear line when a draft was not made for this target."""
    config = draft.config
    args = text_args(target)
    layers = args.num_hidden_layers  # (all of them: a pipeline stage's ``target.layers`` are its own)
    problems = []
    if config.hidden_size != args.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != target's {args.hidden_size}")
    if config.num_target_layers != layers:
        problems.append(f"draft expects {config.num_target_layers} target layers, target has {layers}")
    if config.vocab_size != args.vocab_size:
        problems.append(f"vocab size {config.vocab_size} != target's {args.vocab_size}")
    if not 0 <= config.mask_token_id < args.vocab_size:
        problems.append(f"mask token id {config.mask_token_id} is outside the target vocab (0..{args.vocab_size - 1})")
    bad_ids = [i for i in config.target_layer_ids if not 0 <= i < layers]
    if bad_ids:
        problems.append(f"target_layer_ids {bad_ids} out of range for {layers} layers")
    if problems:
        raise DFlashError("draft does not match target: " + "; ".join(problems))


def load_target(path_or_repo: str, group: Optional[mx.distributed.Group] = None):
    """Load an mlx-lm model and tokenizer (local folder or Hugging Face id), with one-line errors;
    with a ``group``, sharded over its processes (``distributed.shard``: each keeps its part of
    the lazily loaded weights)."""
    from mlx_lm.utils import load

    from .models import resolve

    path_or_repo = resolve(path_or_repo)  # a registered name (e.g. smollm2-135m) -> its folder
    local = Path(path_or_repo).expanduser()
    looks_local = path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1
    if looks_local and not local.exists():
        raise DFlashError(f"model not found: {path_or_repo}")
    source = str(local) if local.exists() else path_or_repo
    config = _config(local) if local.exists() else {}
    if "dflash_config" in config:
        raise DFlashError(f"{path_or_repo} is a DFlash draft, not a target model: pass it as the draft")
    if group is not None and local.exists():
        check_shardable(config.get("model_type", "?"), group)
    try:
        model, tokenizer = load(source, lazy=group is not None)
    except Exception as exc:  # mlx-lm raises many types; the user needs the message, not the stack
        raise DFlashError(f"cannot load model {path_or_repo!r}: {exc}") from None
    if not tokenizer.encode("Hello"):  # (transformers falls back to an empty tokenizer when its files are missing)
        raise DFlashError(f"cannot load model {path_or_repo!r}: its tokenizer encodes no text "
                          "(tokenizer.json or tokenizer.model missing?)")
    if group is not None:
        shard(model, _model_type(model), group)
        mx.eval(model.parameters())
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # (all loaded before any starts)
    warn_half_precision_on_cpu(model, path_or_repo)
    _warn_slow_blas_once()
    return model, tokenizer


def _config(folder: Path) -> dict:
    """A local model folder's config ({} if unreadable: loading says why)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


@functools.cache
def _warn_slow_blas_once() -> None:
    from .blas import slow_blas_warning

    warning = slow_blas_warning()
    if warning:
        print(warning, file=sys.stderr)


def warn_half_precision_on_cpu(model: nn.Module, name: str) -> None:
    """One line on stderr when a bfloat16/float16 model will run on the CPU: there it bypasses
    BLAS. Measured here: one 6-token forward of Qwen2.5-Coder-1.5B took 92 s 4-bit with
    bfloat16 scales vs 1.3 s in float32 with OpenBLAS; the user should not wait for a hang."""
    dtype = float_dtype(model)
    if mx.default_device() == mx.cpu and dtype in (mx.bfloat16, mx.float16):
        print(f"warning: {name} runs in {str(dtype).split('.')[-1]} on the CPU, which is very slow there (no BLAS); use a "
              "float32 copy (registered models: mlx-dflash models fetch NAME --dtype float32)", file=sys.stderr)
