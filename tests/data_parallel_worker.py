"""One process of a tiny data-parallel training run, started by tests/test_train.py through
``mlx.launch -n 2 --backend ring``: TARGET DATA OUT; writes OUT/process-RANK.json."""

import json
import sys
from pathlib import Path

import mlx.core as mx

from mlx_dflash.train import TrainConfig, train


def tiny_config(mask_token_id: int) -> TrainConfig:
    return TrainConfig(layers=1, block_size=8, mask_token_id=mask_token_id, steps=4, batch_size=2, anchors=8,
                       lr=3e-3, eval_every=0, eval_prompts=0, save_every=0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import MASK_ID, load_tiny

    target, data, out = sys.argv[1:4]
    model, tokenizer = load_tiny(target)
    cfg = tiny_config(MASK_ID)
    train(model, tokenizer, [data], out, cfg)
    world = mx.distributed.init()
    summary = {"size": world.size(), "steps": cfg.steps, "losses": [h["loss"] for h in cfg.history if "loss" in h]}
    Path(out, f"process-{world.rank()}.json").write_text(json.dumps(summary))
