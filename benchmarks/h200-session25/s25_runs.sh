#!/usr/bin/env bash
# One device call of the twenty-fifth session (README here), at Qwen3.5-9B's shape unless said
# (scale mode: random bf16 weights), each part optional, in this order:
#   TESTS=1      GPU tests TESTS_TO_RUN within TESTS_TIMEOUT seconds (default 200)
#   COSTS=1      a cycle's pieces, scripts/launch_costs.py --shape qwen3.5-9b (with
#                few_row_products.patch applied: once per entry of PRODUCTS, kernel / cores / mlx)
#   TIMELINE=1   host phases inside one generation, scripts/cycle_timeline.py --scale qwen3.5-9b
#                --replay-mean 6.5, 1,024 tokens
#   DEFAULT_PAIR=1  SmolLM2-135M float32 with its shipped draft, x16 HumanEval, 1,024 tokens
#   RUNS="..."   the replay benchmark (mean acceptance 6.5, 1,024 tokens) once per entry: "-" the
#                tree as carried, a file name a patch beside this script applied for that run only
# Results under $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source .device/b/env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
nvidia-smi --query-gpu=name --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -p no:cacheprovider -o addopts="" -v -rs --durations=10 \
    ${TESTS_TO_RUN:-tests/test_cuda_attention.py tests/test_delta_rule.py} > "$OUT/tests.txt" 2>&1
  echo "pytest rc $?" | tee -a "$OUT/tests.txt"; grep -E "passed|failed|FAILED|Error" "$OUT/tests.txt" | tail -15
fi
if [ -n "${COSTS:-}" ]; then
  for products in ${PRODUCTS:--}; do
    echo "== launch costs, qwen3.5-9b, products $products"
    timeout 200 python3 scripts/launch_costs.py --shape qwen3.5-9b --context ${CONTEXT:-1024} --iters 20 \
      $([ "$products" = - ] || echo --products $products) 2>&1 | tee "$OUT/launch_costs_q35_9b_$products.txt" \
      | grep -vE "^ {10}"
  done
fi
if [ -n "${TIMELINE:-}" ]; then
  echo "== cycle timeline, qwen3.5-9b, replay 6.5"
  timeout 240 python3 scripts/cycle_timeline.py --scale qwen3.5-9b --replay-mean 6.5 --tokens 1024 2>&1 \
    | tee "$OUT/cycle_timeline_q35_9b.txt" | tail -4
fi
if [ -n "${DEFAULT_PAIR:-}" ]; then  # (needs .device/c and d kept, and the draft's weights carried)
  mkdir -p $MLX_DFLASH_HOME/gguf && cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/
  M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype float32 2>&1 | tail -1); echo "model: $M"
  echo "== default pair, x16 HumanEval, 1,024 tokens"
  timeout 300 python3 -m mlx_dflash.cli bench --model "$M" --draft src/mlx_dflash/drafts/smollm2-135m \
    --prompts .device/b/humaneval.jsonl --num-prompts 16 --lengths 1024 --out "$OUT/default_pair" 2>&1 \
    | grep -E '^\| (baseline|dflash)|rror'
  rm -f "$OUT"/default_pair/*.png
fi
R=$OUT/runs; n=0
for entry in ${RUNS:-}; do
  n=$((n + 1)); name=$n-${entry%.patch}; [ "$entry" = - ] && name=$n-tree
  [ "$entry" = - ] || patch -s -p1 < "$here/$entry" || exit 1
  echo "== run $name"
  timeout 240 python3 -m mlx_dflash.cli bench --scale qwen3.5-9b --lengths 1024 --num-prompts 1 \
    --replay-mean 6.5 --out "$R/$name" 2>&1 | grep -E '^\| (baseline|dflash)|rror|_ms'
  [ "$entry" = - ] || patch -s -R -p1 < "$here/$entry"
done
rm -f "$R"/*/*.png
