"""Draft vocabularies: a head restricted to frequent tokens, saved beside the draft."""

import json

import mlx.core as mx
import numpy as np
import mlx.nn as nn
import pytest
from tiny_models import MASK_ID, load_tiny, make_tiny_target, tiny_pair

from mlx_dflash import create_random_draft, generate, load_draft
from mlx_dflash.draft import to_dflash2
from mlx_dflash.draft_io import save_draft
from mlx_dflash.proposer import DFlashProposer
from mlx_dflash.errors import DFlashError
from mlx_dflash.target import Target
from mlx_dflash.train import frequent_tokens


@pytest.mark.parametrize("tie, quantize", [(True, False), (False, False), (True, True), (False, True)])
def test_head_rows_equal_the_full_heads_columns(tiny_dir, tie, quantize):
    """Tied embedding or separate lm_head, plain or quantized: the same logits, fewer columns."""
    model, _ = load_tiny(make_tiny_target(tiny_dir / f"rows-{tie}", "qwen3", tie=tie))
    if quantize:
        nn.quantize(model, group_size=32, bits=8)
    target = Target(model, [0])
    hidden = mx.random.normal((1, 5, target.args.hidden_size))
    ids = mx.array([3, 7, 8, 40, 100], dtype=mx.uint32)
    full = target.head(hidden)
    assert mx.allclose(target.head_rows(ids)(hidden), full[..., ids], atol=1e-5)


def vocab_pair(tiny_dir, name: str, first_id: int):
    """A tiny qwen3 target, a random draft with a draft vocabulary (every third id from
    ``first_id``) and its proposer holding a prompt's context."""
    model, tokenizer, prompt, reference = tiny_pair(tiny_dir / name, "qwen3", "def add(a, b):", 30)
    config = json.loads((tiny_dir / name / "config.json").read_text())
    draft = create_random_draft(config, num_layers=1, block_size=8, mask_token_id=MASK_ID)
    draft.config.draft_vocab = list(range(first_id, config["vocab_size"], 3))
    proposer = DFlashProposer(draft)
    target = Target(model, draft.config.target_layer_ids)
    proposer.start(target)
    _, features = target(mx.array(prompt)[None], target.make_cache())
    proposer.add_context(features)
    return model, tokenizer, prompt, reference, draft, target, proposer


def test_proposals_come_from_the_draft_vocabulary_and_output_stays_exact(tiny_dir):
    model, tokenizer, prompt, reference, draft, _, proposer = vocab_pair(tiny_dir, "vocab-qwen3", 0)
    drafted = proposer.propose(mx.array([5], dtype=mx.uint32), 7).tolist()
    assert all(t in draft.config.draft_vocab for t in drafted)
    result = generate(model, tokenizer, prompt, draft, max_tokens=30)
    assert result.tokens == reference


@pytest.mark.parametrize("queued", [False, True])
def test_options_can_draft_through_the_whole_head_instead(tiny_dir, queued):
    """``EngineOptions(draft_vocab=False)``: greedy drafts are the whole head's argmax (ids
    outside the draft vocabulary too), alone and in a batch, and the output stays the target's."""
    from mlx_dflash.batch import BatchDecoder, batch_generate
    from mlx_dflash.options import EngineOptions

    model, tokenizer, prompt, reference, draft, target, _ = vocab_pair(tiny_dir, "vocab-off-qwen3", 0)
    options = EngineOptions(draft_vocab=False, queue_ahead=queued, compile_blocks=queued, pad_reads=queued)
    whole = DFlashProposer(draft)
    whole.start(Target(model, draft.config.target_layer_ids, options))
    _, features = whole.target(mx.array(prompt)[None], whole.target.make_cache())
    whole.add_context(features)
    first = mx.array([5], dtype=mx.uint32)
    hidden = whole._slot_hidden(first, 7)[0]
    drafted = whole.propose(first, 7).tolist()
    assert drafted == mx.argmax(draft.scale_logits(whole.target.head(hidden)), axis=-1).tolist()
    assert any(t not in draft.config.draft_vocab for t in drafted)
    v2 = DFlashProposer(to_dflash2(draft))  # (its selector walks the whole head's top candidates)
    v2.start(whole.target)
    v2.use_context(whole.context_caches(), len(prompt))
    assert v2.propose(first, 7).tolist() == drafted
    for proposer in (draft, v2.draft):
        assert generate(model, tokenizer, prompt, proposer, max_tokens=30, options=options).tokens == reference
    decoder = BatchDecoder(model, draft, 8, None, None, options)
    assert decoder.draft_vocab is None and BatchDecoder(model, draft, 8).draft_vocab is not None
    rows = [decoder.add(mx.array(p), 30) for p in (prompt, prompt[:5])]
    while decoder.rows:
        decoder.step()
    assert rows[0].tokens == reference
    assert rows[1].tokens == batch_generate(model, [prompt[:5]], draft, [30])[0]


def test_a_tree_takes_its_candidates_from_the_draft_vocabulary(tiny_dir):
    """Trees draft through the draft vocabulary's smaller head too: every node's token is one
    of its ids, and the output is still the target's."""
    from mlx_dflash.engine import decode_cycles
    from mlx_dflash.options import EngineOptions
    from mlx_dflash.tree import device_tree, draft_tree

    _, _, prompt, reference, draft, target, proposer = vocab_pair(tiny_dir, "vocab-tree-qwen3", 1)
    vocab = draft.config.draft_vocab
    logits, columns = proposer.candidate_logits(mx.array([5], dtype=mx.uint32), 7)
    assert logits.shape == (7, len(vocab))
    tree = draft_tree(5, logits, 20, columns)
    assert tree.size == 21 and all(t in vocab for t in tree.tokens[1:])
    on_device = device_tree(mx.array([5]), logits, 20, columns)
    assert set(np.array(on_device.tokens[1:]).tolist()) <= set(vocab)
    queued = EngineOptions(queue_ahead=True, compile_blocks=True, device_trees=True)
    for target in (target, Target(target.model, proposer.layer_ids, queued)):
        cycles = list(decode_cycles(target, DFlashProposer(draft), mx.array(prompt), 30, 8, tree_budget=20))
        assert [t for c in cycles for t in c.tokens] == reference and max(c.block_size for c in cycles) == 21


def test_draft_vocabulary_round_trips_and_bad_files_fail_clearly(tiny_dir, tmp_path):
    config = json.loads((make_tiny_target(tiny_dir / "vocab-io", "qwen3") / "config.json").read_text())
    draft = create_random_draft(config, num_layers=1, block_size=4, mask_token_id=MASK_ID)
    draft.config.draft_vocab = [1, 2, 30]
    save_draft(draft, tmp_path / "d")
    assert load_draft(str(tmp_path / "d")).config.draft_vocab == [1, 2, 30]
    assert json.loads((tmp_path / "d" / "config.json").read_text()).get("draft_vocab") is None  # published format
    for bad in ("[1, 1]", "[-1]", f"[{config['vocab_size']}]", "{", "[]"):
        (tmp_path / "d" / "draft_vocab.json").write_text(bad)
        with pytest.raises(DFlashError, match="draft_vocab.json"):
            load_draft(str(tmp_path / "d"))
    draft.config.draft_vocab = None
    save_draft(draft, tmp_path / "d")  # saving without one removes a stale file
    assert load_draft(str(tmp_path / "d")).config.draft_vocab is None


def test_frequent_tokens_counts_responses_only():
    records = [{"prompt_len": 2, "tokens": [9, 9, 5, 5, 5, 7]}, {"prompt_len": 1, "tokens": [9, 7, 3]}]
    assert frequent_tokens(records, 2) == [5, 7]
    assert frequent_tokens(records, 10) == [3, 5, 7]


def test_the_draft_vocabulary_is_used_off_nvidia_gpus_only(monkeypatch):
    """Measured as fast with the whole head on NVIDIA GPUs (and a few drafts more accepted);
    the CPU and Apple GPUs keep the smaller head. Set, the switch holds on any backend."""
    from mlx_dflash import options as options_module
    from mlx_dflash.options import EngineOptions

    assert EngineOptions().resolved().draft_vocab is True
    monkeypatch.setattr(options_module, "on_gpu", lambda: True)  # (Metal)
    assert EngineOptions().resolved().draft_vocab is True
    monkeypatch.setattr(options_module, "on_cuda", lambda: True)
    assert EngineOptions().resolved().draft_vocab is False
    assert EngineOptions(draft_vocab=True).resolved().draft_vocab is True
