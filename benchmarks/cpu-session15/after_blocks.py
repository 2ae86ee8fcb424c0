"""Plain steps after blocks vs from the start, on the GPU path forced on the CPU (deep-thin)."""
import statistics, sys
import mlx.core as mx
from mlx_dflash import generate, rollback, target as target_module
from mlx_dflash.bench import run_mlx_lm
from mlx_dflash.draft import create_random_draft
from mlx_dflash.policy import BlockPolicy
from mlx_dflash.scale import null_tokenizer, random_target

gpu_path = sys.argv[1] == "gpu-path"
if gpu_path:
    rollback.PAD_READS = True
    target_module.COMPILE_BLOCKS = True
mx.random.seed(0)
model, config = random_target("deep-thin")
model.set_dtype(mx.float32); mx.eval(model.parameters())
tok = null_tokenizer(config["vocab_size"])
draft = create_random_draft(config, num_layers=5, block_size=16, mask_token_id=config["vocab_size"] - 1)
prompt = list(range(1, 33))
N = 400

class BlocksThenPlain(BlockPolicy):
    def choose(self, limit=None):
        self.wants_forecast = False
        self.chosen += 1
        return 16 if self.chosen <= 20 else 1

def plain_ms(policy):
    steps = [s for (b, a, s, f), prev in zip(policy.history[1:], policy.history) if b == 1 and prev[0] == 1]
    return 1000 * statistics.median(steps), len(steps)

for r in range(3):
    base = 1000 * run_mlx_lm(model, tok, prompt, N)[2] / (N - 1)
    out = []
    for name, pol in [("plain only", BlocksThenPlain(16)), ("after 20 blocks", BlocksThenPlain(16))]:
        if name == "plain only":
            pol.chosen = 10**6
        pol.history = []
        generate(model, tok, prompt, draft, max_tokens=N, adaptive=pol, queue_ahead=gpu_path)
        out.append(f"{name} {plain_ms(pol)[0]:.3f} ms ({plain_ms(pol)[1]})")
    print(f"round {r}: mlx-lm {base:.3f} ms/token; dflash plain steps median: " + ", ".join(out), flush=True)
