#!/usr/bin/env bash
set -uo pipefail
source .device/b/env.sh >/dev/null
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
M=/tmp/mlxd/models/smollm2-135m-bfloat16
[ -d $M ] || { mkdir -p $MLX_DFLASH_HOME/gguf; cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/; M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype bfloat16 2>&1 | tail -1); }
[ -d /tmp/random_draft ] || python3 -c "
import json, sys; from mlx_dflash.draft import create_random_draft, save_draft
save_draft(create_random_draft(json.load(open(sys.argv[1])), num_layers=5, block_size=16, mask_token_id=16), sys.argv[2])" "$M/config.json" /tmp/random_draft
python3 .device/patches/s19_forecast_probe.py $M /tmp/random_draft .device/b/humaneval.jsonl 2>&1 | tee $OUT/forecast_probe.txt
