#!/usr/bin/env bash
# Stages everything the device scripts use; run from the checkout root on this machine:
#   bash scripts/device/stage_all.sh            (QWEN_PAIR=0: without the Qwen pair)
# .device/a, .device/b: MLX (CUDA) + mlx-lm, HumanEval prompts (.device/b/humaneval.jsonl);
# .device/c, .device/d: SmolLM2-135M's GGUF; .device/q01...: the Qwen2.5-Coder 0.5B/1.5B pair
# in 4-bit (for bench_gpu.sh PARTS=speculative), 55 MiB a folder; .device/saved: the saved
# training sets (kept under /opt/stage like the others); .device/data: prompt files (below).
# Then, on the device: `bash .device/X/keep.sh` with .device/X carried, for a, then every
# other folder with a keep.sh, then the script itself with .device/b (and .device/data)
# carried: env.sh re-joins the pieces under $DEVICE_FILES. See ../shared/device/README.md.
# A call carries at most 64 MiB with the tracked tree, which holds the shipped draft (~24 MB in
# all): for the lease, untrack the draft's weights (git rm --cached D/model.safetensors; add it to
# .git/info/exclude), carry that path in the calls that need it, and `git reset` it afterwards.
# Background jobs across calls (train on one GPU, bench on the other): scripts/device/bg.sh.
set -euo pipefail
export MLX_DFLASH_HOME=${MLX_DFLASH_HOME:-$HOME/.cache/mlx-dflash}
mlx-dflash models fetch smollm2-135m >/dev/null
bash ../shared/device/stage-mlx-cuda "$MLX_DFLASH_HOME/gguf/smollm2-135m.gguf"
python -m mlx_dflash.bench_prompts > .device/b/humaneval.jsonl
# pytest for the device (bench_gpu.sh PARTS=hybrid runs the CUDA kernel's test there)
python -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux_2_35_x86_64 \
  -d .device/b pytest  # env.sh installs every wheel there
if [ "${QWEN_PAIR:-1}" = 1 ]; then
  pair=$(mktemp -d)
  for model in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
    ln -s "$(mlx-dflash models fetch $model --dtype bfloat16 --quantize 4 | tail -1)" "$pair/$model"
  done
  tar chf - -C "$pair" qwen2.5-coder-0.5b qwen2.5-coder-1.5b | split -b 55M - "$pair/qwen-pair-q4.tar.split."
  n=0
  for piece in "$pair"/qwen-pair-q4.tar.split.*; do
    n=$((n + 1)); dir=.device/q$(printf %02d $n); mkdir -p $dir
    mv "$piece" $dir/ && cp .device/c/keep.sh $dir/
  done
  rm -rf "$pair"
fi
# the saved SmolLM2 data sets, each as .device/saved/FOLDER.sequences.jsonl.gz, kept as
# /opt/stage/FOLDER.sequences.jsonl.gz (train_default_draft.sh unpacks it to /tmp/work/FOLDER,
# where STAGE=data resumes it): stdlib (42,258 responses), completion (4,736), package prompts
# (2 x 26,112, 2 x 12,303, 2 x 32,768 and 28,160); 39 MB in all (one keep call with the
# tracked tree, less the draft's weights)
saved=$HOME/.cache/mlx-dflash-training-data
mkdir -p .device/saved && cp .device/c/keep.sh .device/saved/
for pair in data:session5-stdlib-all completion:session4-completion packages-1:session6-packages-1 \
            packages-2:session6-packages-2 packages3-1:session7-packages3-1 packages3-2:session7-packages3-2 \
            packages45-1:session8-packages45-1 packages45-2:session8-packages45-2 \
            packages6-1:session9-packages6-1; do
  file=$saved/${pair#*:}-sequences.jsonl.gz
  if [ -f "$file" ]; then cp "$file" .device/saved/${pair%%:*}.sequences.jsonl.gz; fi
done
# PROMPT_PACKAGES="numpy sympy ...": prompts from these installed packages' docstrings, every
# code-completion request (first: a timed data run answers them before the rest) and
# PACKAGE_QUESTIONS others drawn at random (seed 0; up to the seventh session: the first ones, so
# the first packages named filled the quota), in two halves (one per GPU),
# saved as ~/.cache/mlx-dflash-training-data/prompts/PROMPT_NAME-{1,2}.jsonl.gz. Every prompt
# set saved there is staged as .device/data/NAME-{1,2}.jsonl.gz (for train_default_draft.sh
# STAGE=data PROMPTS=...; .device is rebuilt on each run); move a set to prompts/answered/ once
# its responses are saved. A new prompt set needs a new PROMPT_NAME: data runs resume by prompt
# number into the folder of that name.
mkdir -p "$saved/prompts" .device/data
if [ -n "${PROMPT_PACKAGES:-}" ]; then
  python -c "
import gzip, json, random, sys
from mlx_dflash.data import package_prompts
prompts = package_prompts(sys.argv[4:])
is_completion = lambda p: '\`\`\`python' in p
others = [p for p in prompts if not is_completion(p)]
random.Random(0).shuffle(others)
chosen = [p for p in prompts if is_completion(p)] + others[: int(sys.argv[1])]
for half in (1, 2):
    with gzip.open(f'{sys.argv[3]}/{sys.argv[2]}-{half}.jsonl.gz', 'wt') as f:
        f.writelines(json.dumps({'prompt': p}) + '\n' for p in chosen[half - 1 :: 2])
print(f'{len(chosen)} package prompts')" "${PACKAGE_QUESTIONS:-38000}" "${PROMPT_NAME:-packages}" "$saved/prompts" \
    $PROMPT_PACKAGES
fi
cp "$saved"/prompts/*.jsonl.gz .device/data/ 2>/dev/null || true
du -sh .device/* | tr '\n' ' '; echo
