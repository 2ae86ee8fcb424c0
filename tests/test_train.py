"""Training on the CPU with tiny models: mask, loss going down, reload, resume."""

import ast
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from data_parallel_worker import tiny_config
from launch import run_launch
from tiny_models import MASK_ID, greedy_reference, load_tiny, make_tiny_target

from mlx.utils import tree_flatten

from mlx_dflash import DFlashError, create_random_draft, generate, load_draft
from mlx_dflash.data import (_function_header, answer_order, build_dataset, greedy_batch, package_prompts, read_sequences,
                             stdlib_prompts)
from mlx_dflash.train import (TrainConfig, context_visibility, held_out_and_training_records, make_batch,
                              read_training_records, split_held_out, train)


def test_context_visibility_matches_brute_force():
    rng = np.random.default_rng(0)
    B, A, T = 2, 5, 23
    anchors = np.sort(rng.integers(0, T - 1, size=(B, A)), axis=1)
    sees = np.array(context_visibility(mx.array(anchors), T))
    for b in range(B):
        for i in range(A):
            for j in range(T):
                assert sees[b, i, j] == (j < anchors[b, i])


def test_training_forward_equals_decoding_each_block_alone(tiny_dir):
    """All blocks in one masked pass == each block drafted on its own with the context
    strictly before its anchor (the decode path): the block mask is exactly right."""
    path = make_tiny_target(tiny_dir / "mask-qwen3", "qwen3")
    config = json.loads((path / "config.json").read_text())
    draft = create_random_draft(config, num_layers=2, block_size=4, mask_token_id=MASK_ID)
    mx.random.seed(3)
    B, T, A, bs, H = 2, 20, 3, 4, 64
    context = draft.project_context(mx.random.normal((B, T, H * len(draft.config.target_layer_ids))))
    blocks = mx.random.normal((B, A * bs, H))
    anchors = mx.array([[2, 9, 17], [5, 6, 18]])
    together = draft.forward_blocks(blocks, context, anchors, context_visibility(anchors, T))
    for b in range(B):
        for i in range(A):
            a = anchors[b, i].item()
            alone = draft(blocks[b : b + 1, i * bs : (i + 1) * bs], context[b : b + 1, :a], draft.make_cache())
            assert mx.allclose(together[b, i * bs : (i + 1) * bs], alone[0], atol=1e-4), (b, i)


def test_batch_labels_follow_the_anchors():
    record = {"id": 0, "prompt_len": 4, "tokens": list(range(100, 120))}
    cfg = TrainConfig(block_size=4, anchors=3, max_len=64)
    batch = make_batch([record], cfg, MASK_ID, np.random.default_rng(1))
    anchors = np.array(batch["anchors"])[0]
    blocks = np.array(batch["block_tokens"]).reshape(3, 4)
    labels = np.array(batch["labels"])[0]
    weights = np.array(batch["weights"])[0]
    for i, a in enumerate(anchors):
        assert 4 <= a <= 18  # response positions with a successor
        assert blocks[i, 0] == 100 + a and (blocks[i, 1:] == MASK_ID).all()
        n = min(3, 19 - a)
        assert list(labels[i, :n]) == [100 + a + k for k in range(1, n + 1)]
        assert np.allclose(weights[i, :n], np.exp(-np.arange(n) / cfg.loss_gamma()))
        assert (weights[i, n:] == 0).all()


def test_batch_labels_of_records_of_every_length():
    """Records longer than max_len, shorter than the batch, and with fewer response positions
    than anchors (the rest padding: weight 0): every label against the record's own tokens."""
    records = [{"id": 0, "prompt_len": 3, "tokens": list(range(200, 240))},  # cut at max_len
               {"id": 1, "prompt_len": 2, "tokens": [7, 8, 9, 10, 11]},  # 2 response positions, 6 anchors
               {"id": 2, "prompt_len": 5, "tokens": list(range(50, 70))}]
    cfg = TrainConfig(block_size=5, anchors=6, max_len=32)
    batch = make_batch(records, cfg, MASK_ID, np.random.default_rng(3))
    anchors, labels, weights = (np.array(batch[k]) for k in ("anchors", "labels", "weights"))
    decay = np.exp(-np.arange(4) / cfg.loss_gamma())
    for b, record in enumerate(records):
        seq = record["tokens"][: cfg.max_len]
        picked = min(cfg.anchors, len(seq) - 1 - record["prompt_len"])
        for i in range(cfg.anchors):
            for k in range(4):
                position = anchors[b, i] + 1 + k
                live = i < picked and position < len(seq)
                assert labels[b, i, k] == (seq[position] if live else 0), (b, i, k)
                assert weights[b, i, k] == pytest.approx(decay[k] if live else 0.0), (b, i, k)
    assert (weights[1, 2:] == 0).all() and (anchors[1, 2:] == 0).all()


def test_batch_labels_index_the_draft_vocabulary():
    """With a draft vocabulary the loss ranks only its tokens: labels become head columns and
    a label outside the vocabulary weighs nothing."""
    record = {"id": 0, "prompt_len": 2, "tokens": [5, 6, 7, 8, 9, 10, 11, 12]}
    cfg = TrainConfig(block_size=4, anchors=5, max_len=64)
    vocab_index = np.full(32, -1, np.int32)
    vocab = [6, 7, 9, 10, 11, 12]  # 8 is not in it
    vocab_index[vocab] = np.arange(len(vocab))
    plain = make_batch([record], cfg, MASK_ID, np.random.default_rng(2))
    mapped = make_batch([record], cfg, MASK_ID, np.random.default_rng(2), vocab_index)
    labels, weights = np.array(plain["labels"]), np.array(plain["weights"])
    mapped_labels, mapped_weights = np.array(mapped["labels"]), np.array(mapped["weights"])
    live = weights > 0
    in_vocab = live & (labels != 8)
    assert (mapped_labels[in_vocab] == vocab_index[labels[in_vocab]]).all()
    assert (mapped_weights[in_vocab] == weights[in_vocab]).all()
    assert (mapped_weights[live & (labels == 8)] == 0).all() and (labels[live] == 8).any()


def test_mixed_precision_keeps_float32_master_weights(tiny_data, tmp_path):
    """bfloat16 passes, float32 weights: updates far below bfloat16's resolution still land."""
    path, data = tiny_data
    model, tokenizer = load_tiny(path)
    base = dict(layers=1, block_size=8, mask_token_id=MASK_ID, batch_size=2, anchors=8, eval_every=0,
                eval_prompts=0, save_every=0, warmup=0.0)
    first = train(model, tokenizer, [str(data)], str(tmp_path / "first"), TrainConfig(**base, steps=1))
    cfg = TrainConfig(**base, steps=3, lr=1e-7, compute_dtype="bfloat16")
    second = train(model, tokenizer, [str(data)], str(tmp_path / "second"), cfg, init=str(first))
    before, after = dict(tree_flatten(load_draft(str(first)).parameters())), load_draft(str(second))
    changed = 0
    for name, weight in tree_flatten(after.parameters()):
        assert weight.dtype == mx.float32, name
        assert mx.abs(weight - before[name]).max() < 1e-5, name  # bfloat16's resolution at 0.05: 2e-4
        changed += not mx.array_equal(weight, before[name])
    assert changed == len(before)  # ... and yet every weight moved


def test_stdlib_prompts_are_offline_and_not_benchmarks():
    prompts = stdlib_prompts()
    assert len(prompts) > 1000 and len(set(prompts)) == len(prompts)
    assert not any("HumanEval" in p or "has_close_elements" in p for p in prompts)


def test_prompts_never_spell_out_this_process(monkeypatch):
    """A default that prints its object (cgi's ``environ=os.environ``) once copied every
    environment variable into the prompts: such headers are left out."""
    monkeypatch.setenv("MLX_DFLASH_PROMPT_MARKER", "zq-marker-5531")
    assert not any("zq-marker-5531" in p for p in stdlib_prompts())


def test_package_prompts_come_from_installed_packages():
    prompts = package_prompts(["tqdm"])
    assert len(prompts) > 100 and prompts == package_prompts(["tqdm"])  # deterministic
    assert any("```python\n" in p for p in prompts) and any("tqdm.contrib" in p for p in prompts)
    with pytest.raises(DFlashError, match="no_such_package"):
        package_prompts(["no_such_package"])


def test_completion_only_keeps_just_the_requests_to_complete_a_function():
    every = package_prompts(["tqdm"])
    completions = package_prompts(["tqdm"], completion_only=True)
    assert 10 < len(completions) < len(every) and set(completions) < set(every)
    assert all("```python\ndef " in p for p in completions)
    assert all(p in completions for p in every if "```python\ndef " in p)


def test_package_prompts_skip_objects_that_raise_when_inspected(tmp_path, monkeypatch):
    """Django's unconfigured settings raise on any attribute read, its lazy translations on
    repr: such objects (and headers showing them) are left out, not the whole package."""
    (tmp_path / "lazy_pkg.py").write_text('''
class _Unconfigured:
    def __getattribute__(self, name):
        raise RuntimeError("settings are not configured")

class _NoRepr:
    def __repr__(self):
        raise RuntimeError("no translation yet")

settings = _Unconfigured()

def greet(name, greeting=_NoRepr()):
    """Return a friendly greeting for the given person by name."""

def add_numbers(a, b):
    """Add two numbers together and return their sum to the caller."""
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = package_prompts(["lazy_pkg"])
    assert any("def add_numbers(a, b):" in p for p in prompts)
    assert not any("def greet(" in p for p in prompts) and any("friendly greeting" in p for p in prompts)


def test_completion_headers_keep_doctest_examples():
    """A completion request shows the description and the doctest examples (not their heading),
    like a user's "complete this function"; a docstring too long for both keeps the description."""
    def clamp(x, low, high):
        """Clamp x into [low, high].

        Values below low become low.

        Examples
        --------
        >>> clamp(5, 0, 3)
        3
        """

    header = _function_header("clamp", clamp)
    assert ">>> clamp(5, 0, 3)\n    3\n" in header and "Examples" not in header
    assert "Values below low become low." in header and ast.parse(header)
    clamp.__doc__ += "\n>>> " + "x" * 900
    assert ">>>" not in _function_header("clamp", clamp)

    def first(items):
        """Return the first item.

        Args:
            items: A list.

        Example:

            >>> first([4, 5])
            4
        """

    assert '    """\n    Return the first item.\n' in _function_header("first", first)
    assert "\n    >>> first([4, 5])\n    4\n" in _function_header("first", first)  # not indented further


def test_completion_prompts_hold_valid_python_headers():
    """The code-completion prompts show a function header and docstring that parse as Python."""
    completions = [p for p in stdlib_prompts() if "```python\n" in p]
    assert len(completions) > 1000
    for prompt in completions[:200]:
        code = prompt.split("```python\n")[1].split("\n```")[0]
        tree = ast.parse(code)
        assert isinstance(tree.body[0], ast.FunctionDef) and ast.get_docstring(tree.body[0])


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5"])
def test_batched_greedy_equals_mlx_lm_greedy(tiny_dir, family):
    """Left-padded static batches (KV, rotating and recurrent caches) give each prompt's
    own greedy tokens, cut after the first EOS."""
    model, tokenizer = load_tiny(make_tiny_target(tiny_dir / f"batch-{family}", family))
    prompts = [tokenizer.encode(text) for text in ["def add(a, b):", "x", "Sort a list of numbers quickly."]]
    references = [greedy_reference(model, p, 24) for p in prompts]
    assert greedy_batch(model, prompts, 24, eos_ids=set()) == references
    stop = references[0][5]  # an "EOS" seen early in the first reference
    cut = greedy_batch(model, prompts, 24, eos_ids={stop})
    for got, ref in zip(cut, references):
        assert got == (ref[: ref.index(stop) + 1] if stop in ref else ref)


def test_prompts_are_answered_in_windows_sorted_by_length_so_a_stopped_run_holds_every_length():
    lengths = [(7 * i) % 40 + 1 for i in range(100)]  # shuffled lengths 1..40
    todo = [(i, [5] * n) for i, n in enumerate(lengths)]
    order = answer_order(todo, batch_size=4, batches_per_window=2)
    assert sorted(order) == sorted(todo)
    for start in range(0, 100, 8):  # each window: the next 8 prompts, shortest first
        window = order[start : start + 8]
        assert sorted(i for i, _ in window) == list(range(start, min(start + 8, 100)))
        assert [len(ids) for _, ids in window] == sorted(len(ids) for _, ids in window)
    assert max(len(ids) for _, ids in order[:8]) > sorted(lengths)[7]  # not just the shortest prompts


@pytest.fixture(scope="module")
def tiny_data(tiny_dir):
    path = make_tiny_target(tiny_dir / "train-qwen3", "qwen3")
    model, tokenizer = load_tiny(path)
    data = build_dataset(model, tokenizer, stdlib_prompts()[:12], tiny_dir / "train-data", max_tokens=48,
                         batch_size=6)
    return path, data


def test_data_is_resumable(tiny_data, tiny_dir):
    path, data = tiny_data
    records = read_sequences(data)
    assert sorted(r["id"] for r in records) == list(range(12))
    model, tokenizer = load_tiny(path)
    build_dataset(model, tokenizer, stdlib_prompts()[:12], data, max_tokens=48)  # nothing left to do
    assert len(read_sequences(data)) == 12
    # an interrupted run leaves half a line: resuming drops it and regenerates that prompt
    file = data / "sequences.jsonl"
    lines = file.read_text().splitlines(keepends=True)
    file.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    build_dataset(model, tokenizer, stdlib_prompts()[:12], data, max_tokens=48)
    assert sorted(r["id"] for r in read_sequences(data)) == list(range(12))


def test_tiny_training_run_loss_falls_and_draft_reloads(tiny_data, tmp_path):
    path, data = tiny_data
    model, tokenizer = load_tiny(path)
    cfg = TrainConfig(layers=1, intermediate_size=48, block_size=8, mask_token_id=MASK_ID, steps=40, batch_size=4,
                      anchors=16, lr=3e-3, eval_every=0, eval_prompts=2, eval_tokens=16, save_every=0)
    draft_dir = train(model, tokenizer, [str(data)], str(tmp_path / "run"), cfg)
    losses = [h["loss"] for h in cfg.history if "loss" in h]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    assert (tmp_path / "run" / "training.png").stat().st_size > 0
    draft = load_draft(str(draft_dir))
    assert draft.config.block_size == 8 and draft.config.mask_token_id == MASK_ID
    assert draft.config.intermediate_size == 48  # (narrower than the target's MLP)
    prompt = read_sequences(data)[0]
    result = generate(model, tokenizer, prompt["tokens"][: prompt["prompt_len"]], draft, max_tokens=24)
    assert len(result.tokens) > 0 and result.cycles > 0


def test_sequences_shorter_than_a_block_train_and_a_foreign_mask_id_fails(tiny_data, tmp_path):
    """--max-len below a block (the target's forward without a cache at a block's length), and a
    mask token id the target does not have: one clear error, not a crash."""
    path, data = tiny_data
    model, tokenizer = load_tiny(path)
    base = dict(layers=1, block_size=8, steps=2, batch_size=2, anchors=4, eval_every=0, eval_prompts=0, save_every=0)
    short = train(model, tokenizer, [str(data)], str(tmp_path / "short"), TrainConfig(**base, max_len=4))
    assert (short / "config.json").is_file()
    for mask in (-1, model.args.vocab_size):
        with pytest.raises(DFlashError, match="the mask token id must be one of the target's"):
            train(model, tokenizer, [str(data)], str(tmp_path / "mask"), TrainConfig(**base, mask_token_id=mask))


def test_resume_continues_from_the_saved_step(tiny_data, tmp_path):
    path, data = tiny_data
    model, tokenizer = load_tiny(path)
    base = dict(layers=1, block_size=8, mask_token_id=MASK_ID, batch_size=2, anchors=8, eval_every=0,
                eval_prompts=0, save_every=5)
    out = tmp_path / "run"
    train(model, tokenizer, [str(data)], str(out), TrainConfig(**base, steps=5))
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 5
    cfg = TrainConfig(**base, steps=8)
    train(model, tokenizer, [str(data)], str(out), cfg, resume=True)
    steps = [h["step"] for h in json.loads((out / "history.json").read_text()) if "loss" in h]
    assert steps == list(range(1, 9))  # 1..5 from the first run, 6..8 after resuming
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 8


def test_init_starts_from_the_given_draft(tiny_data, tmp_path):
    """--init: the run starts from a trained draft's weights (its first step has learning rate 0,
    so a one-step run returns them unchanged) and with its shape, not the config's."""
    path, data = tiny_data
    model, tokenizer = load_tiny(path)
    base = dict(mask_token_id=MASK_ID, batch_size=2, anchors=8, eval_every=0, eval_prompts=0, save_every=0)
    first = train(model, tokenizer, [str(data)], str(tmp_path / "first"), TrainConfig(**base, layers=1,
                                                                                    block_size=8, steps=6))
    cfg = TrainConfig(**base, layers=3, block_size=4, steps=1)
    second = train(model, tokenizer, [str(data)], str(tmp_path / "second"), cfg, init=str(first))
    before, after = load_draft(str(first)), load_draft(str(second))
    assert after.config.num_hidden_layers == 1 and after.config.block_size == 8
    for (name, a), (_, b) in zip(tree_flatten(before.parameters()), tree_flatten(after.parameters())):
        assert mx.array_equal(a, b), name


def test_data_parallel_run_trains_one_draft_on_both_processes(tiny_data, tmp_path):
    """Two processes (mlx.launch, ring backend on this host): the same steps and losses in both,
    the same final weights (train checks, else it fails), one writer, and a draft unlike one
    process's run with the same seed: the other process's batches counted."""
    path, data = tiny_data
    out = tmp_path / "parallel"
    run = run_launch([sys.executable, str(Path(__file__).parent / "data_parallel_worker.py"), str(path), str(data),
                      str(out)], timeout=300)
    files = [out / f"process-{rank}.json" for rank in (0, 1)]  # mlx.launch's exit status says 0 either way
    assert run.returncode == 0 and all(f.is_file() for f in files), run.stdout[-2000:] + run.stderr[-2000:]
    processes = [json.loads(f.read_text()) for f in files]
    assert [p["size"] for p in processes] == [2, 2] and [p["steps"] for p in processes] == [4, 4]
    assert processes[0]["losses"] == processes[1]["losses"]
    assert len(json.loads((out / "history.json").read_text())) == 4
    model, tokenizer = load_tiny(path)
    alone = load_draft(str(train(model, tokenizer, [str(data)], str(tmp_path / "alone"), tiny_config(MASK_ID))))
    together = load_draft(str(out / "draft"))
    pairs = zip(tree_flatten(alone.parameters()), tree_flatten(together.parameters()))
    assert any(not mx.array_equal(a, b) for (_, a), (_, b) in pairs)


def test_held_out_records_are_a_seeded_sample_kept_out_of_training():
    records = [{"id": i} for i in range(100)]
    held_out, training = split_held_out(records, 8, seed=0)
    assert len(held_out) == 8 and len(training) == 92
    assert {r["id"] for r in held_out}.isdisjoint(r["id"] for r in training)
    assert split_held_out(records, 8, seed=0) == (held_out, training)  # a resumed run: the same split
    assert any(r["id"] < 50 for r in held_out)  # from anywhere, not the tail of the last folder
    assert split_held_out(records, 0, seed=0) == ([], records)


def test_training_reads_several_data_folders(tiny_data, tmp_path):
    _, data = tiny_data
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "sequences.jsonl").write_text((data / "sequences.jsonl").read_text())
    one, two = read_training_records([str(data)]), read_training_records([str(data), str(copy)])
    assert len(one) > 0 and two == one + one


def test_held_out_prompts_can_come_from_one_folder(tmp_path):
    folders = []
    for name, first_id in (("old", 0), ("new", 100)):
        folder = tmp_path / name
        folder.mkdir()
        records = [{"id": first_id + i, "tokens": [1, 2, 3, 4], "prompt_len": 1} for i in range(20)]
        (folder / "sequences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        folders.append(str(folder))
    cfg = TrainConfig(eval_prompts=5, held_out_from=str(tmp_path / "." / "new"))
    held_out, training = held_out_and_training_records(folders, cfg)
    assert len(held_out) == 5 and all(r["id"] >= 100 for r in held_out)
    assert len(training) == 35 and {r["id"] for r in held_out}.isdisjoint(r["id"] for r in training)
    held_anywhere, _ = held_out_and_training_records(folders, TrainConfig(eval_prompts=5))
    assert len(held_anywhere) == 5
    with pytest.raises(DFlashError, match="not one of the --data folders"):
        held_out_and_training_records(folders[:1], cfg)


def test_time_budget_shortens_the_run(tiny_data, tmp_path):
    path, data = tiny_data
    model, tokenizer = load_tiny(path)
    cfg = TrainConfig(layers=1, block_size=8, mask_token_id=MASK_ID, steps=1000, batch_size=2, anchors=4,
                      eval_every=0, eval_prompts=0, save_every=0, time_budget=1e-6)
    train(model, tokenizer, [str(data)], str(tmp_path / "run"), cfg)
    assert cfg.steps == 10 and len([h for h in cfg.history if "loss" in h]) == 10
