#!/usr/bin/env bash
# One device call of the twenty-fourth session, at Qwen3.5-9B's shape (scale mode: random bf16
# weights): optionally the GPU tests of the Gated DeltaNet kernel, the block attention kernel and
# the compiled hybrid blocks (TESTS=1), a cycle's pieces (COSTS=1, scripts/launch_costs.py
# --shape qwen3.5-9b: eager and compiled verify), then the replay benchmark (mean acceptance 6.5,
# 1,024 tokens) once per entry of RUNS, in order: "-" is the tree as carried, a file name a patch
# beside this script applied for that run only.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source .device/b/env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
nvidia-smi --query-gpu=name --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -p no:cacheprovider -o addopts="" -v -rs ${TESTS_TO_RUN:-tests/test_delta_rule.py \
    tests/test_cuda_attention.py tests/test_families.py::test_compiled_blocks_equal_eager_ones \
    tests/test_families.py::test_queued_cycles_equal_greedy} > "$OUT/tests.txt" 2>&1; echo "pytest rc $?" | tee -a "$OUT/tests.txt"; tail -3 "$OUT/tests.txt"
fi
if [ -n "${COSTS:-}" ]; then
  echo "== launch costs, qwen3.5-9b"
  timeout 200 python3 scripts/launch_costs.py --shape qwen3.5-9b --context ${CONTEXT:-1024} --iters 20 \
    --rowwise ${ROWWISE:-off} 2>&1 \
    | tee "$OUT/launch_costs_q35_9b.txt" | grep -vE "^ {10}"
fi
R=$(mktemp -d); n=0
for entry in ${RUNS:-}; do
  n=$((n + 1)); name=$n-${entry%.patch}; [ "$entry" = - ] && name=$n-tree
  [ "$entry" = - ] || patch -s -p1 < "$here/$entry" || exit 1
  echo "== run $name"
  timeout 240 python3 -m mlx_dflash.cli bench --scale qwen3.5-9b --lengths 1024 --num-prompts 1 \
    --replay-mean 6.5 --out "$R/$name" 2>&1 | grep -E '^\| (baseline|dflash)|rror|_ms'
  [ "$entry" = - ] || patch -s -R -p1 < "$here/$entry"
done
tar czf "$OUT/runs.tgz" -C "$R" .
