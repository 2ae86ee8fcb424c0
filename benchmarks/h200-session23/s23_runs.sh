#!/usr/bin/env bash
# One device call of the twenty-third session: optionally the CUDA kernel's tests on the GPU
# (TESTS=1) and a cycle's pieces with row-by-row target products on and off (COSTS=1,
# scripts/launch_costs.py), then the default pair (x16 HumanEval, 1,024 tokens, float32) once per
# entry of RUNS, in order: "-" is the tree as carried, a file name a patch beside this script
# applied for that run only. FLOOR=1 then runs a random 5-layer draft (x16, the floor).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source .device/b/env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
nvidia-smi --query-gpu=name --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
  timeout 200 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rs tests/test_cuda_attention.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
fi
mkdir -p $MLX_DFLASH_HOME/gguf
[ -f $MLX_DFLASH_HOME/gguf/smollm2-135m.gguf ] || cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/
M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype float32 2>&1 | tail -1); echo "model: $M"
D=src/mlx_dflash/drafts/smollm2-135m
if [ -n "${COSTS:-}" ]; then
  for rowwise in on off; do
    echo "== launch costs, row by row $rowwise"
    timeout 150 python3 scripts/launch_costs.py --model "$M" --draft "$D" --rowwise $rowwise 2>&1 \
      | tee "$OUT/launch_costs_rowwise_$rowwise.txt" | grep -E "queued|primitives|equal"
  done
fi
R=$(mktemp -d); n=0
for entry in ${RUNS:-}; do
  n=$((n + 1)); name=$n-${entry%.patch}; [ "$entry" = - ] && name=$n-tree
  [ "$entry" = - ] || patch -s -p1 < "$here/$entry" || exit 1
  echo "== run $name"
  timeout 280 python3 -m mlx_dflash.cli bench --model "$M" --draft "$D" --prompts .device/b/humaneval.jsonl \
    --num-prompts 16 --lengths 1024 --out "$R/$name" 2>&1 | grep -E '^\| (baseline|dflash)|rror'
  [ -f "$R/$name/results.json" ] && python3 scripts/per_text_overhead.py "$R/$name/results.json" | tail -1
  [ "$entry" = - ] || patch -s -R -p1 < "$here/$entry"
done
if [ -n "${FLOOR:-}" ]; then
  echo "== floor: a random draft"
  python3 -c "
import json, sys; from mlx_dflash.draft import create_random_draft, save_draft
save_draft(create_random_draft(json.load(open(sys.argv[1])), num_layers=5, block_size=16,
           mask_token_id=json.load(open(sys.argv[2]))['dflash_config']['mask_token_id']), '/tmp/random_draft')" \
    "$M/config.json" "$D/config.json"
  timeout 200 python3 -m mlx_dflash.cli bench --model "$M" --draft /tmp/random_draft --prompts .device/b/humaneval.jsonl \
    --num-prompts 16 --lengths 1024 --out "$R/floor" 2>&1 | grep -E '^\| (baseline|dflash)|rror'
fi
tar czf "$OUT/runs.tgz" -C "$R" .
