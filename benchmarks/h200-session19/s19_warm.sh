#!/usr/bin/env bash
# Qwen3.5-9B shape, replay 6.5: where a bench's first text pays what a second does not.
# 1) cycle_series after a bench-like warm-up (300 tokens on another prompt), two runs, slowest cycles;
# 2) the replay bench with --repeats 3 (each repeat: mlx-lm then DFlash on the same prompt).
set -uo pipefail
source .device/b/env.sh >/dev/null
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
python3 scripts/cycle_series.py --scale qwen3.5-9b --tokens 1024 --runs 2 --warm-tokens 300 2>&1 | tee $OUT/series_warm300_1024.txt
python3 -m mlx_dflash.cli bench --scale qwen3.5-9b --lengths 1024 4096 --num-prompts 1 --replay-mean 6.5 --repeats 3 \
  --out $OUT/replay_repeats 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -30
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/replay_repeats/results.json"))
for run in r["runs"]:  # each generation in order: the repeats of one length side by side
    n = len(run["tokens"]) - 1
    acc = run["acceptance_lengths"]
    print(run["method"], run["length"], f"{n / run['decode_s']:.1f} tok/s", f"acceptance {sum(acc) / len(acc):.2f}" if acc else "")
PY
