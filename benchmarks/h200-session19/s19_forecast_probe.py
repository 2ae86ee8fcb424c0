"""Where a forecast's time goes on the GPU: the floor's adaptive generations (random draft,
x4 HumanEval 1,024, EOS on, one shared policy), with each draft pass split into its parts,
each synced (this script only wraps the proposer instance's methods)."""
import json, sys, time
import mlx.core as mx
from mlx_dflash import generate, load_draft, load_target
from mlx_dflash.data import encode_chat
from mlx_dflash.engine import DFlashProposer
from mlx_dflash.policy import BlockPolicy
model, tok = load_target(sys.argv[1])
draft = load_draft(sys.argv[2], dtype=mx.bfloat16)
prompts = [json.loads(l)["prompt"] for l in open(sys.argv[3])][:4]
rows = []

class Probe(DFlashProposer):
    def _store_singles(self):
        n = len(self.single)
        t = time.perf_counter(); super()._store_singles(); mx.eval(self.state); s = time.perf_counter() - t
        self._probe = (n, s)
    def propose(self, first, num):
        self._probe = (0, 0.0)
        mx.eval(first)
        t = time.perf_counter(); out = super().propose(first, num); mx.eval(out); total = time.perf_counter() - t
        n, store = self._probe
        ctx = self.cache[0].length
        rows.append((num, n, 1000 * store, 1000 * (total - store), ctx, self.cache[0].read_size()))
        return out

policy = BlockPolicy(16)
for rep in range(2):
    for i, p in enumerate(prompts):
        rows.clear()
        r = generate(model, tok, encode_chat(tok, p), Probe(draft), max_tokens=1024, adaptive=policy)
        print(f"run {rep} prompt {i}: {len(r.tokens)} tokens, {r.decode_tokens_per_sec:.1f} tok/s")
        for num, n, store, rest, ctx, read in rows:
            if num >= 15 or n > 1:
                print(f"   draft of {num:2d}: stored {n:3d} singles in {store:6.2f} ms, pass {rest:6.2f} ms, context {ctx}, read {read}")
