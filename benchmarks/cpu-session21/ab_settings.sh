#!/usr/bin/env bash
# Settings side by side, alternating processes: `mlx-dflash bench` (HumanEval, 256 tokens) once per
# setting per round, each setting a Python statement run before the CLI (module flags).
# Usage: [PYTHON=venv/bin/python] N=8 ROUNDS=2 BLOCK=16 OUTDIR=DIR bash ab_settings.sh LABEL 'STATEMENT' [LABEL 'STATEMENT' ...]
#   e.g. off 'import mlx_dflash.cpu_kernels as k; k.USE_CPU_KERNELS = False'  on 'pass'
#   (a statement may also set BLOCK, the bench's --block-size: block8 'BLOCK = 8')
set -euo pipefail
export OPENBLAS_CORETYPE=SkylakeX LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
export PYTHONPATH=src MLX_DFLASH_HOME=${MLX_DFLASH_HOME:-$HOME/.cache/mlx-dflash}
for round in $(seq 1 "${ROUNDS:-2}"); do
  args=("$@")
  for ((i = 0; i < ${#args[@]}; i += 2)); do
    label=${args[i]}; statement=${args[i+1]}
    echo "== round $round, $label: $statement"
    ${PYTHON:-python} -c "
import sys
BLOCK = ${BLOCK:-16}
$statement
from mlx_dflash.cli import main
sys.argv = ['mlx-dflash', 'bench', '--num-prompts', '${N:-8}', '--lengths', '256', '--block-size', str(BLOCK),
            '--out', '$OUTDIR/$label-$round']
main()" 2>&1 | grep -v "it/s\]$" | tail -5 | grep -v "^bench:"
  done
done
