#!/usr/bin/env bash
# The floor (random draft, x4 HumanEval 1,024, EOS on): singles stored in block-sized chunks
# (committed) against one store of all pending ones (s19_singles_old.patch), two rounds in turn.
set -uo pipefail
source .device/b/env.sh >/dev/null
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
mkdir -p $MLX_DFLASH_HOME/gguf; cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/
M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype bfloat16 2>&1 | tail -1); echo "model: $M"
python3 -c "
import json, sys; from mlx_dflash.draft import create_random_draft, save_draft
save_draft(create_random_draft(json.load(open(sys.argv[1])), num_layers=5, block_size=16, mask_token_id=16), sys.argv[2])" \
  "$M/config.json" /tmp/random_draft
ROUNDS=2 bash scripts/device/ab.sh .device/patches/s19_singles_old.patch --model "$M" --draft /tmp/random_draft \
  --prompts .device/b/humaneval.jsonl --num-prompts 4 --lengths 1024
