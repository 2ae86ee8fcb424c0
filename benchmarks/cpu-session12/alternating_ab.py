# Run: PYTHONPATH=<checkout>/src python alternating_ab.py LABEL (prints one line)
import sys, time
from mlx_dflash.bench import humaneval_prompts, run_mlx_lm, run_dflash
from mlx_dflash.data import encode_chat
from mlx_dflash.draft import load_draft
from mlx_dflash.engine import DFlashProposer
from mlx_dflash.target import float_dtype, load_target
import mlx_dflash
model, tok = load_target("smollm2-135m")
draft = load_draft(str(__import__("pathlib").Path(mlx_dflash.__file__).parent / "drafts/smollm2-135m"), dtype=float_dtype(model))
prompts = [encode_chat(tok, t) for t in humaneval_prompts()[:3]]
run_mlx_lm(model, tok, prompts[0], 32); run_dflash(model, tok, prompts[0], 32, DFlashProposer(draft), None)
base = dfl = 0.0; ntok = ndf = 0
for p in prompts:
    t, _, d, _ = run_mlx_lm(model, tok, p, 256); base += d; ntok += len(t) - 1
    t2, _, d2, acc = run_dflash(model, tok, p, 256, DFlashProposer(draft), None); dfl += d2; ndf += len(t2) - 1
print(f"{sys.argv[1]}: mlx-lm {ntok/base:.2f} tok/s, dflash fixed {ndf/dfl:.2f} tok/s, ratio {(ndf/dfl)/(ntok/base):.3f}x", flush=True)
