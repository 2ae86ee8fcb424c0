from mlx_dflash import generate, load_draft, load_target
from mlx_dflash.bench import humaneval_prompts, run_mlx_lm
from mlx_dflash.data import encode_chat
from mlx_dflash.policy import BlockPolicy
from mlx_dflash.target import float_dtype
model, tok = load_target("smollm2-135m")
draft = load_draft("src/mlx_dflash/drafts/smollm2-135m", dtype=float_dtype(model))
texts = humaneval_prompts()
log = []
class P(BlockPolicy):
    def record(self, block, acceptance, seconds, forecast=False):
        log.append((("f" if forecast else block), acceptance, round(seconds * 1000)))
        super().record(block, acceptance, seconds, forecast)
pol = P(16)
generate(model, tok, encode_chat(tok, texts[0]), draft, max_tokens=64, adaptive=pol)
for i in range(4):
    log.clear()
    r = generate(model, tok, encode_chat(tok, texts[i]), draft, max_tokens=256, adaptive=pol)
    f = generate(model, tok, encode_chat(tok, texts[i]), draft, max_tokens=256, block_size=16)
    print(i, f"adaptive {r.decode_seconds:.2f}s fixed {f.decode_seconds:.2f}s", {k: round(v*1000) for k, v in sorted(pol.seconds.items())})
    print("   ", log)
