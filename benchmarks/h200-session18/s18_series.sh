#!/usr/bin/env bash
# Qwen3.5-9B shape, replay 6.5: cycle times by context, twice in one process (scripts/cycle_series.py)
set -uo pipefail
source .device/b/env.sh >/dev/null
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
python3 scripts/cycle_series.py --scale qwen3.5-9b --tokens 1024 --runs 2 2>&1 | tee $OUT/series_1024.txt
python3 scripts/cycle_series.py --scale qwen3.5-9b --tokens 2048 --runs 1 2>&1 | tee $OUT/series_2048.txt
