#!/usr/bin/env bash
# new code (/work/main) then the code as the session began (/tmp/ptest = d77676e), twice, alternating
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 MLX_DFLASH_HOME=$HOME/.cache/mlx-dflash
for round in 1 2; do
  for tree in /work/main /tmp/ptest; do
    name=$( [ $tree = /work/main ] && echo new || echo old )
    (cd $tree && PYTHONPATH=src /tmp/venv/bin/python -m mlx_dflash.cli bench --num-prompts 4 --lengths 256 --out /tmp/cpu16/bench_${name}$round 2>&1 | grep -E '^\|' > /tmp/cpu16/bench_${name}$round.txt)
  done
done
