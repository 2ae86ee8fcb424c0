"""``mlx-dflash train``: the DFlash training recipe, in one file.

Per step: pick sequences (prompt + the target's own response), run the frozen
target once over them to get the tapped hidden states, put up to ``anchors``
blocks ``[x_a, MASK, ..., MASK]`` at random response positions ``a``, and run
every block of a sequence through the draft in ONE pass: a block sees the
context strictly before its anchor and itself (bidirectionally), never another
block (``DraftAttention.attend_blocks``). Loss: cross-entropy at block slots k = 1..bs-1 against
x_(a+k), weighted exp(-(k-1)/gamma). AdamW, warm-up + cosine, grad clipping;
the target's embedding and head stay frozen (they are not draft parameters).
Mixed precision: float32 master weights, the passes in the target's dtype (bfloat16
on GPUs, faster steps; float32 on the CPU). A draft with a draft vocabulary learns to rank
only those tokens, through those rows of the head (faster again).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from tqdm import tqdm

from .data import read_sequences
from .draft import DFlashDraft, create_random_draft, to_dflash2, top_k_columns
from .draft_config import DFlash2Config
from .draft_io import dequantize_draft, is_quantized, load_draft, save_draft
from .errors import DFlashError
from .target import Target, check_compatible, float_dtype, text_args

GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}
PROBE_STEPS = 10  # steps run before a time budget sets the run's length...
PROBE_WARMUP = 2  # ...timed after these (the first steps compile, and would overstate a step's cost)


@dataclass
class TrainConfig:
    layers: int = 5
    intermediate_size: Optional[int] = None  # the draft's MLP width; default: the target's
    block_size: int = 16
    target_layer_ids: Optional[list[int]] = None
    mask_token_id: Optional[int] = None
    steps: int = 2000
    batch_size: int = 8  # sequences per step
    anchors: int = 512  # blocks per sequence (fewer when the response is shorter)
    max_len: int = 1024  # sequences are cut to this many tokens
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: Optional[float] = None
    eval_every: int = 250
    eval_prompts: int = 8  # held-out sequences whose prompts measure acceptance
    held_out_from: Optional[str] = None  # draw them from this data folder only (default: from all)
    eval_tokens: int = 128
    save_every: int = 500
    seed: int = 0
    time_budget: Optional[float] = None  # seconds: fewer steps when the first ones show they won't fit
    draft_vocab: Optional[int] = None  # greedy drafts choose among this many frequent response tokens
    compute_dtype: Optional[str] = None  # the passes' dtype; default: the target's (master weights stay float32)
    arch: str = "dflash"  # or "dflash2": convolutions and a candidate selector (a fine-tune of a v1 draft with init)
    selector_weight: float = 1.0  # DFlash2: the selector loss's weight beside the block loss
    kernel_lr_scale: float = 1.0  # DFlash2: the convolutions' kernel projections learn at this fraction of lr
    selector_lr_scale: float = 1.0  # DFlash2: the candidate selector learns at this multiple of lr
    conv_taps: Optional[int] = None  # DFlash2: taps of its convolutions (None: the published 2; 0: none)
    history: list = field(default_factory=list)  # filled while training; saved with checkpoints

    def loss_gamma(self) -> float:
        return self.gamma or GAMMA_BY_BLOCK.get(self.block_size, 7.0 * self.block_size / 16)


def choose_mask_token(tokenizer, vocab_size: int) -> int:
    """A token id the target never emits in chat: ``<|MASK|>`` if present, else a reserved
    special token that is not BOS/EOS/PAD/UNK (e.g. SmolLM2's ``<empty_output>``)."""
    vocab = tokenizer.get_vocab()
    if "<|MASK|>" in vocab:
        return vocab["<|MASK|>"]
    busy = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    busy |= set(tokenizer.eos_token_ids)
    chat_tokens = {"<|im_start|>", "<|im_end|>", "<|endoftext|>"}
    specials = [i for t, i in vocab.items() if t in tokenizer.all_special_tokens or
                (t.startswith("<") and t.endswith(">") and len(t) > 2)]
    candidates = sorted(i for i in specials if i not in busy and i < vocab_size
                        and tokenizer.convert_ids_to_tokens(i) not in chat_tokens)
    if not candidates:
        raise DFlashError("the tokenizer has no spare special token for the mask; pass --mask-token-id")
    return candidates[-1]


# ---------------------------------------------------------------------------
# Batches and the block mask


def sample_anchors(record: dict, max_anchors: int, max_len: int, rng: np.random.Generator) -> np.ndarray:
    """Random response positions a with a + 1 inside the sequence (sorted)."""
    length = min(len(record["tokens"]), max_len)
    choices = np.arange(record["prompt_len"], length - 1)
    if choices.size == 0:
        return choices
    return np.sort(rng.choice(choices, size=min(max_anchors, choices.size), replace=False))


def context_visibility(anchors: mx.array, context_len: int) -> mx.array:
    """[B, A, T]: block i sees context position j iff j < anchors[:, i] (strictly before it).

    Padding anchors (weight 0) sit at position 0: they see no context, only their own block."""
    return mx.arange(context_len)[None, None, :] < anchors[:, :, None]


def make_batch(records: list[dict], cfg: TrainConfig, mask_token_id: int, rng: np.random.Generator,
               vocab_index: Optional[np.ndarray] = None) -> dict:
    """Token ids, anchors, block inputs, visibility, labels and loss weights of one step.

    ``vocab_index`` (token id -> column of a draft-vocabulary head, -1 if absent): labels
    become those columns; a label outside the vocabulary gets weight 0."""
    bs = cfg.block_size
    anchors = [sample_anchors(r, cfg.anchors, cfg.max_len, rng) for r in records]
    # Few distinct shapes (anchors fixed, length in steps of 128): MLX CUDA builds and caches
    # an attention graph per shape; padding costs a little compute instead.
    longest = max(min(len(r["tokens"]), cfg.max_len) for r in records)
    A, T = cfg.anchors, min(cfg.max_len, -(-longest // 128) * 128)
    tokens = np.zeros((len(records), T), np.int32)
    anchor_pos = np.zeros((len(records), A), np.int32)
    labels = np.zeros((len(records), A, bs - 1), np.int32)
    weights = np.zeros((len(records), A, bs - 1), np.float32)
    decay = np.exp(-np.arange(bs - 1) / cfg.loss_gamma())
    for b, (record, picked) in enumerate(zip(records, anchors)):
        seq = np.asarray(record["tokens"][: cfg.max_len])
        tokens[b, : seq.size] = seq
        anchor_pos[b, : picked.size] = picked
        for i, a in enumerate(picked):
            target = seq[a + 1 : a + bs]
            labels[b, i, : target.size] = target
            weights[b, i, : target.size] = decay[: target.size]
    truth = np.concatenate([np.take_along_axis(tokens, anchor_pos, axis=1)[..., None], labels], axis=-1)
    valid = weights > 0  # (before the draft vocabulary: the selector ranks any token)
    if vocab_index is not None:
        labels = vocab_index[labels]
        weights[labels < 0] = 0
        labels = np.maximum(labels, 0)
    block_tokens = np.full((len(records), A, bs), mask_token_id, np.int32)
    block_tokens[:, :, 0] = np.take_along_axis(tokens, anchor_pos, axis=1)
    return {
        "tokens": mx.array(tokens),
        "anchors": mx.array(anchor_pos),
        "block_tokens": mx.array(block_tokens.reshape(len(records), A * bs)),
        "sees_context": context_visibility(mx.array(anchor_pos), T),
        "labels": mx.array(labels),
        "weights": mx.array(weights),
        "truth": mx.array(truth),  # [B, A, bs]: each block's tokens (global ids), for a selector's loss
        "valid": mx.array(valid),
    }


def block_loss(draft: DFlashDraft, target: Target, head: Callable[[mx.array], mx.array], batch: dict,
               features: mx.array, head_ids: Optional[mx.array] = None, selector_weight: float = 1.0) -> mx.array:
    """Decay-weighted cross-entropy of the draft's block predictions through ``head`` (the
    target's, or its draft-vocabulary rows ``head_ids``); for a DFlash2 draft plus
    ``selector_weight`` times its selector's loss."""
    B, A = batch["anchors"].shape
    bs = draft.block_size
    embeddings = draft.scale_embeddings(target.embed(batch["block_tokens"]))
    hidden = draft.forward_blocks(embeddings, draft.project_context(features), batch["anchors"], batch["sees_context"])
    hidden = hidden.reshape(B, A, bs, -1)[:, :, 1:]
    # the head is most of the FLOPs: run it in the target's dtype (bf16 on GPUs), the loss in float32
    logits = draft.scale_logits(head(hidden.astype(features.dtype)).astype(mx.float32))
    losses = nn.losses.cross_entropy(logits, batch["labels"], reduction="none")
    loss = (losses * batch["weights"]).sum() / mx.maximum(batch["weights"].sum(), 1e-6)
    if draft.config.dflash2 is None:
        return loss
    return loss + selector_weight * selector_loss(draft, hidden.astype(mx.float32), logits, batch, head_ids)


def selector_loss(draft: DFlashDraft, hidden: mx.array, logits: mx.array, batch: dict,
                  head_ids: Optional[mx.array]) -> mx.array:
    """DFlash2's selector loss: cross-entropy over each slot's top-k candidates of the true
    token's index, the true previous token as the predecessor (teacher forcing); slots whose
    true token is not among the candidates are skipped."""
    selector = draft.candidate_selector
    k = min(draft.config.dflash2.selector_top_k, logits.shape[-1])
    local = mx.stop_gradient(top_k_columns(logits, k))  # [B, A, n, k]
    candidates = local if head_ids is None else head_ids[local]
    previous, true = batch["truth"][..., :-1], batch["truth"][..., 1:]  # [B, A, n]: global ids
    query = selector.predecessor_codebook(previous) * selector.hidden_projection(hidden)  # [B, A, n, rank]
    scores = mx.take_along_axis(logits, local, axis=-1) + (selector.successor_codebook(candidates)
                                                           @ query[..., None])[..., 0]
    hit = candidates == true[..., None]
    counted = hit.any(axis=-1) & batch["valid"]
    losses = nn.losses.cross_entropy(scores, mx.argmax(hit, axis=-1), reduction="none")
    return (losses * counted).sum() / mx.maximum(counted.sum(), 1)


# ---------------------------------------------------------------------------
# Evaluation, checkpoints, plot


def held_out_acceptance(target_model, tokenizer, draft: DFlashDraft, records: list[dict], max_tokens: int) -> float:
    """Mean acceptance length of greedy DFlash on held-out prompts."""
    from .generate import generate

    lengths = []
    for record in records:
        result = generate(target_model, tokenizer, record["tokens"][: record["prompt_len"]], draft,
                          max_tokens=max_tokens)
        lengths += result.acceptance_lengths
    return float(np.mean(lengths)) if lengths else 0.0


def save_checkpoint(out: Path, draft: DFlashDraft, optimizer, cfg: TrainConfig, step: int) -> None:
    save_draft(draft, out / "draft")
    ckpt = out / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(ckpt / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
    tmp = ckpt / "state.json.tmp"
    tmp.write_text(json.dumps({"step": step, "config": asdict(cfg)}))
    tmp.replace(ckpt / "state.json")


def plot_history(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [h["step"] for h in history if "loss" in h]
    ax.plot(steps, [h["loss"] for h in history if "loss" in h], color="tab:blue", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("weighted block loss", color="tab:blue")
    evals = [h for h in history if "acceptance" in h]
    if evals:
        ax2 = ax.twinx()
        ax2.plot([h["step"] for h in evals], [h["acceptance"] for h in evals], "o-", color="tab:orange")
        ax2.set_ylabel("mean acceptance length (held out)", color="tab:orange")
    ax.set_title("DFlash draft training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------
# The loop


def read_training_records(data_dirs: list[str]) -> list[dict]:
    """The sequences of every data folder, in a fixed order (folder, then id), that have a
    response of at least two tokens."""
    records = []
    for data_dir in data_dirs:
        records += sorted(read_sequences(data_dir), key=lambda r: r["id"])
    return [r for r in records if len(r["tokens"]) - r["prompt_len"] >= 2]


def frequent_tokens(records: list[dict], size: int) -> list[int]:
    """The ``size`` most frequent response tokens of ``records`` (sorted ids): a draft
    vocabulary. In SmolLM2-135M's own responses the top 8,192 of 49,152 ids cover 99.95%
    of the tokens, so drafting from them loses almost nothing and skips 5/6 of the head."""
    responses = np.concatenate([np.asarray(r["tokens"][r["prompt_len"]:], np.int64) for r in records])
    counts = np.bincount(responses)
    top = np.argsort(-counts, kind="stable")[:size]
    return sorted(int(t) for t in top if counts[t] > 0)


def split_held_out(records: list[dict], count: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(held out, training): ``count`` records drawn at random (seeded: a resumed run holds out the
    same ones) from all data folders, rather than the last ones, which `mlx-dflash data` writes
    sorted by prompt length (the longest prompts of the last folder only)."""
    held = set(np.random.default_rng(seed).permutation(len(records))[:count].tolist())
    return [r for i, r in enumerate(records) if i in held], [r for i, r in enumerate(records) if i not in held]


def held_out_and_training_records(data_dirs: list[str], cfg: TrainConfig) -> tuple[list[dict], list[dict]]:
    """(held out, training) records of ``data_dirs``. With ``cfg.held_out_from`` the held-out
    prompts come from that folder only: a fine-tuned draft (``--init``) may have trained on the
    earlier folders' records, which would make its held-out acceptance a score on training data."""
    pool_dirs = list(data_dirs)
    if cfg.held_out_from:
        chosen = [d for d in data_dirs if Path(d).resolve() == Path(cfg.held_out_from).resolve()]
        if not chosen:
            raise DFlashError(f"--held-out-from {cfg.held_out_from} is not one of the --data folders")
        pool_dirs = chosen
    pool = read_training_records(pool_dirs)
    if len(pool) <= cfg.eval_prompts:
        raise DFlashError(f"{', '.join(pool_dirs)}: {len(pool)} usable sequences; need more than {cfg.eval_prompts}")
    held_out, training = split_held_out(pool, cfg.eval_prompts, cfg.seed)
    return held_out, read_training_records([d for d in data_dirs if d not in pool_dirs]) + training


def check_in_sync(draft: DFlashDraft, world: mx.distributed.Group) -> None:
    """Data-parallel processes apply the same averaged gradients to the same start, so they must
    end with the same weights: a fingerprint per process (the sum of all weights), compared."""
    fingerprint = sum(mx.sum(p.astype(mx.float32)) for _, p in tree_flatten(draft.parameters()))
    every = mx.distributed.all_gather(fingerprint.reshape(1), group=world)
    if not mx.all(every == every[0]).item():
        raise DFlashError(f"data-parallel training diverged: weight sums per process {every.tolist()}")


def dflash2_config(cfg: TrainConfig) -> DFlash2Config:
    """The DFlash2 part of a draft this run creates: the published one, or with ``conv_taps``."""
    return DFlash2Config() if cfg.conv_taps is None else DFlash2Config(conv_kernel_size=cfg.conv_taps)


def make_optimizer(cfg: TrainConfig, schedule: Callable[[mx.array], mx.array]) -> optim.Optimizer:
    """AdamW on ``schedule``; a DFlash2 draft's kernel projections on ``kernel_lr_scale`` times it
    and its candidate selector on ``selector_lr_scale`` times it.
    Started from zero (the identity of a v1 draft), Adam's first steps move all of a projection's
    weights at once, which throws a trained draft's proposals off before the rest can adapt. The
    selector's score is a product of three small factors (a zero successor codebook among them):
    at a fine-tune's learning rate it barely leaves zero in a short run."""
    adamw = optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay)
    if cfg.arch != "dflash2":
        return adamw
    groups = [(cfg.kernel_lr_scale, "kernel_projection"), (cfg.selector_lr_scale, "candidate_selector")]
    groups = [(scale, part) for scale, part in groups if scale != 1.0]
    if not groups:
        return adamw

    def scaled(scale: float) -> optim.Optimizer:
        return optim.AdamW(learning_rate=lambda step: scale * schedule(step), weight_decay=cfg.weight_decay)

    return optim.MultiOptimizer([scaled(scale) for scale, _ in groups] + [adamw],
                                [lambda path, _, part=part: part in path for _, part in groups])


def train(target_model, tokenizer, data_dirs: list[str], out_dir: str, cfg: TrainConfig, resume: bool = False,
          init: Optional[str] = None) -> Path:
    """Train a draft for ``target_model`` on the sequences in ``data_dirs``; returns the draft folder.

    ``init``: start from this draft's weights (fine-tuning, e.g. on new data) instead of random ones.
    Launched as several processes (``mlx.launch -n 2 ...``: one per GPU, through NCCL on CUDA),
    the run is data-parallel: every process starts from the same weights, draws its own batches
    and applies the averaged gradients, so each step sees ``batch_size`` x processes sequences;
    process 0 alone evaluates, plots and writes."""
    world = mx.distributed.init()  # a group of one unless launched with mlx.launch
    writer = world.rank() == 0
    out = Path(out_dir)
    held_out, records = held_out_and_training_records(data_dirs, cfg)

    start_step = 0
    state_file = out / "checkpoint" / "state.json"
    if resume and state_file.is_file():
        state = json.loads(state_file.read_text())
        cfg = TrainConfig(**{**state["config"], "steps": cfg.steps, "time_budget": cfg.time_budget})
        start_step = state["step"]
        draft = load_draft(str(out / "draft"), dtype=mx.float32)
    elif resume:
        raise DFlashError(f"nothing to resume in {out}")
    elif init:
        draft = load_draft(init)
        if is_quantized(draft):
            draft = dequantize_draft(draft, mx.float32)
        draft.set_dtype(mx.float32)
        check_compatible(draft, target_model)
        if cfg.arch == "dflash2":
            draft = to_dflash2(draft, dflash2_config(cfg))  # (a v1 draft: the identity start, a fine-tune from its drafts)
        v2 = draft.config.dflash2
        if v2 is not None and cfg.conv_taps is not None and cfg.conv_taps != v2.conv_kernel_size:
            raise DFlashError(f"--conv-taps {cfg.conv_taps}: the --init draft's convolutions have "
                              f"{v2.conv_kernel_size} taps (a DFlash2 draft keeps its own)")
        cfg.layers, cfg.block_size = draft.config.num_hidden_layers, draft.block_size
        cfg.intermediate_size = draft.config.intermediate_size
        cfg.target_layer_ids, cfg.mask_token_id = draft.config.target_layer_ids, draft.config.mask_token_id
    else:
        vocab_size = text_args(target_model).vocab_size
        if cfg.mask_token_id is None:
            cfg.mask_token_id = choose_mask_token(tokenizer, vocab_size)
        elif not 0 <= cfg.mask_token_id < vocab_size:
            raise DFlashError(f"the mask token id must be one of the target's (0..{vocab_size - 1}), "
                              f"got {cfg.mask_token_id}")
        draft = create_random_draft(
            vars(text_args(target_model)), num_layers=cfg.layers, block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id, target_layer_ids=cfg.target_layer_ids,
            intermediate_size=cfg.intermediate_size, seed=cfg.seed,
            dflash2=dflash2_config(cfg) if cfg.arch == "dflash2" else None,
        )
        draft.config.context_window = cfg.max_len  # it never sees more context than this in training
        draft.set_dtype(mx.float32)
    cfg.arch = "dflash" if draft.config.dflash2 is None else "dflash2"  # (an --init DFlash2 draft stays one)
    if cfg.arch == "dflash" and (cfg.kernel_lr_scale != 1.0 or cfg.selector_lr_scale != 1.0 or cfg.conv_taps is not None):
        raise DFlashError("--kernel-lr-scale, --selector-lr-scale and --conv-taps shape a DFlash2 draft: "
                          "train one with --arch dflash2")
    if cfg.draft_vocab and not start_step:
        draft.config.draft_vocab = frequent_tokens(records, cfg.draft_vocab)
    target = Target(target_model, draft.config.target_layer_ids)
    target_model.freeze()
    head, vocab_index, head_ids = target.head, None, None
    if draft.config.draft_vocab:
        head_ids = mx.array(draft.config.draft_vocab)
        head = target.head_rows(head_ids)
        vocab_index = np.full(text_args(target_model).vocab_size, -1, np.int32)
        vocab_index[draft.config.draft_vocab] = np.arange(len(draft.config.draft_vocab))
    compute_dtype = getattr(mx, cfg.compute_dtype) if cfg.compute_dtype else float_dtype(target_model)

    def schedule(step: mx.array) -> mx.array:
        """Linear warm-up, then cosine to 5%; reads cfg.steps each time (a time budget may change it)."""
        warmup = max(1, int(cfg.warmup * cfg.steps))
        s = step.astype(mx.float32)
        progress = mx.clip((s - warmup) / max(1, cfg.steps - warmup), 0.0, 1.0)
        cosine = cfg.lr * (0.05 + 0.95 * 0.5 * (1 + mx.cos(math.pi * progress)))
        return mx.where(s < warmup, cfg.lr * s / warmup, cosine)

    optimizer = make_optimizer(cfg, schedule)
    if start_step:
        optimizer.init(draft.trainable_parameters())
        saved = mx.load(str(out / "checkpoint" / "optimizer.safetensors"))
        optimizer.state = tree_unflatten(list(saved.items()))

    def loss_fn(master: dict, batch: dict, features: mx.array) -> mx.array:
        """The loss at a ``compute_dtype`` copy of the float32 master weights; its gradients
        come back in float32 (through the cast)."""
        draft.update(tree_map(lambda p: p.astype(compute_dtype), master))
        return block_loss(draft, target, head, batch, features, head_ids, cfg.selector_weight)

    loss_and_grad = mx.value_and_grad(loss_fn)
    rng = np.random.default_rng(cfg.seed + start_step + 1_000_003 * world.rank())  # own batches per process
    bar = tqdm(initial=start_step, total=cfg.steps, desc="train", unit="step", disable=not writer)
    tic = time.perf_counter()
    step = start_step
    while step < cfg.steps:
        picked = rng.choice(len(records), size=min(cfg.batch_size, len(records)), replace=False)
        batch = make_batch([records[i] for i in picked], cfg, draft.config.mask_token_id, rng, vocab_index)
        _, features = target(batch["tokens"], None)
        master = draft.trainable_parameters()
        loss, grads = loss_and_grad(master, batch, mx.stop_gradient(features))
        if world.size() > 1:
            grads = nn.average_gradients(grads, world)
            loss = mx.distributed.all_sum(loss, group=world) / world.size()
        grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        draft.update(optimizer.apply_gradients(grads, master))
        mx.eval(loss, draft.parameters(), optimizer.state)
        cfg.history.append({"step": step + 1, "loss": loss.item(), "seconds": time.perf_counter() - tic})
        bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.update(1)
        if step + 1 - start_step == PROBE_WARMUP:
            probe_tic = time.perf_counter()
        if cfg.time_budget and step + 1 - start_step == PROBE_STEPS:  # fit the run into the budget
            per_step = (time.perf_counter() - probe_tic) / (PROBE_STEPS - PROBE_WARMUP)
            if world.size() > 1:  # every process must take the same number of steps: process 0's
                per_step = mx.distributed.all_sum(mx.array(per_step if writer else 0.0), group=world).item()
            cfg.steps = max(step + 1, min(cfg.steps, start_step + int(cfg.time_budget / per_step)))
            bar.total = cfg.steps
            if writer:
                bar.write(f"{per_step * 1000:.0f} ms/step: {cfg.steps} steps fit in the {cfg.time_budget:.0f} s budget")
        last = step + 1 == cfg.steps
        if writer and held_out and (last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
            acceptance = held_out_acceptance(target_model, tokenizer, draft, held_out, cfg.eval_tokens)
            cfg.history.append({"step": step + 1, "acceptance": acceptance})
            bar.write(f"step {step + 1}: loss {loss.item():.3f}, held-out mean acceptance length {acceptance:.2f}")
        if writer and (last or (cfg.save_every and (step + 1) % cfg.save_every == 0)):
            save_checkpoint(out, draft, optimizer, cfg, step + 1)
            plot_history(cfg.history, out / "training.png")
        step += 1
    bar.close()
    if world.size() > 1:
        check_in_sync(draft, world)
    if writer:
        (out / "history.json").write_text(json.dumps(cfg.history))
    return out / "draft"
