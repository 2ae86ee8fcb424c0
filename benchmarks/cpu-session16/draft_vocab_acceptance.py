"""Mean acceptance of the shipped draft choosing among its 8,192-token draft vocabulary vs the whole
vocabulary (HumanEval prompts 10-15, 128 tokens, 16-token blocks; CPU, float32)."""
from mlx_dflash import generate
from mlx_dflash.bench import humaneval_prompts
from mlx_dflash.data import encode_chat
from mlx_dflash.draft import load_draft
from mlx_dflash.models import DEFAULT_MODEL, shipped_draft
from mlx_dflash.target import float_dtype, load_target
model, tok = load_target(DEFAULT_MODEL)
draft = load_draft(shipped_draft(DEFAULT_MODEL), dtype=float_dtype(model))
vocab = draft.config.draft_vocab
ps = [encode_chat(tok, t) for t in humaneval_prompts()[10:16]]
for name, v in [("draft vocab", vocab), ("full vocab", None)]:
    draft.config.draft_vocab = v
    acc = []
    for p in ps:
        acc += generate(model, tok, p, draft, max_tokens=128).acceptance_lengths
    print(name, len(acc), "cycles, mean acceptance", round(sum(acc) / len(acc), 3), flush=True)
