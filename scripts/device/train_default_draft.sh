#!/usr/bin/env bash
# Trains the shipped draft for SmolLM2-135M-Instruct (or a draft for MODEL) on the lent H200s
# (MLX CUDA). Each device call must stay under 10 minutes, so the work is split into stages (env
# STAGE); scripts/device/bg.sh runs a stage past a call's end:
#   STAGE=data         self-distillation data from every stdlib prompt -> $OUT/sequences.jsonl.gz.part.*
#   STAGE=data PROMPTS=completion   only the code-completion prompts (into $W/completion)
#   STAGE=data PROMPTS=.device/data/NAME.jsonl.gz   a prompt file (into $W/NAME)
#   STAGE=train        train a new draft on every data set in $W (RUN=folder, default $W/run;
#                      its bf16 and 8-bit forms go to $RUN-ship; LR, default 6e-4)
#   STAGE=train RESUME_STEPS=N      continue that run, cosine stretched to N steps
#   STAGE=train INIT=DRAFT          fine-tune DRAFT (e.g. the shipped one) instead of a random draft;
#                                   HELD_OUT=FOLDER (a data set DRAFT never saw): held-out prompts from it
#   STAGE=train PROBE=1             first, ms per step side by side (scripts/train_step_costs.py)
#   STAGE=train GPUS=2              one data-parallel run over both GPUs (mlx.launch, NCCL)
# Data sets from earlier sessions come as /opt/stage/FOLDER.sequences.jsonl.gz (keep .device/saved).
# Staging: `QWEN_PAIR=0 bash scripts/device/stage_all.sh` here (see its header), then on the
#   device `bash .device/X/keep.sh` for a, c, d and saved, then carry .device/b (and .device/data)
#   and run e.g. `STAGE=data bash scripts/device/train_default_draft.sh`.
# Knobs (env): DATA_SECONDS, TRAIN_SECONDS, LAYERS, BATCH, VOCAB (draft vocabulary, default 8192).
# MODEL: another target (an mlx-lm folder, e.g. /tmp/models/qwen2.5-coder-1.5b, which
#   `PARTS=speculative bash scripts/device/bench_gpu.sh` unpacks); its work goes to
#   /tmp/work-NAME, and the saved SmolLM2 data sets are not used for it.
set -uo pipefail
source .device/b/env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
MODEL=${MODEL:-smollm2-135m}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
quiet() { tr '\r' '\n' | grep -Ev '(prompt|step)/s(, [a-z]+=[^]]*)?\]$' ; }
if [ "$MODEL" = smollm2-135m ]; then
  W=/tmp/work; mkdir -p $W $MLX_DFLASH_HOME/gguf
  [ -f $MLX_DFLASH_HOME/gguf/smollm2-135m.gguf ] || cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/
  python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype bfloat16 2>&1 | tail -1
  for saved in /opt/stage/*.sequences.jsonl.gz; do  # saved data sets (stage_all.sh), once per machine
    name=$(basename "$saved" .sequences.jsonl.gz)
    [ -f "$saved" ] && [ ! -f $W/$name/sequences.jsonl ] && mkdir -p $W/$name && zcat "$saved" > $W/$name/sequences.jsonl
  done
else
  W=/tmp/work-$(basename "$MODEL"); mkdir -p $W
fi
if [ "${STAGE:-data}" = data ]; then
  # self-distillation data (resumable: a timeout keeps finished chunks)
  DATA=$W/data; PROMPT_ARGS=()
  if [[ "${PROMPTS:-all}" == *.jsonl.gz ]]; then  # a prompt file (stage_all.sh PROMPT_PACKAGES=...)
    name=$(basename "$PROMPTS" .jsonl.gz); DATA=$W/$name; PROMPT_ARGS=(--prompts $W/$name.jsonl)
    zcat "$PROMPTS" > $W/$name.jsonl; wc -l $W/$name.jsonl
  elif [ "${PROMPTS:-all}" = completion ]; then
    DATA=$W/completion; PROMPT_ARGS=(--prompts $W/completion.jsonl)
    python3 -c "
import json; from mlx_dflash.data import stdlib_prompts
print(''.join(json.dumps({'prompt': p}) + '\\n' for p in stdlib_prompts() if '\`\`\`python' in p), end='')" > $W/completion.jsonl
    wc -l $W/completion.jsonl
  fi
  time timeout "${DATA_SECONDS:-400}" python3 -m mlx_dflash.cli data --model "$MODEL" --out $DATA \
    "${PROMPT_ARGS[@]}" --max-tokens 384 --batch-size "${BATCH:-512}" 2>&1 | quiet | tail -3
  python3 -c "
import json; r=[json.loads(l) for l in open('$DATA/sequences.jsonl')]
print(f'sequences: {len(r)}, response tokens: {sum(len(x[\"tokens\"]) - x[\"prompt_len\"] for x in r)}')"
  gzip -c $DATA/sequences.jsonl | split -b 15M - "$OUT"/$(basename $DATA).jsonl.gz.part.
else
  DATA_DIRS=($(ls -d $W/*/sequences.jsonl | xargs -n1 dirname)); echo "data: ${DATA_DIRS[*]}"
  RUN=${RUN:-$W/run}; SHIP=$RUN-ship
  [ -n "${PROBE:-}" ] && python3 scripts/train_step_costs.py --model "$MODEL" --data "${DATA_DIRS[@]}" 2>&1 | quiet | grep ms/step
  if [ -n "${RESUME_STEPS:-}" ]; then  # a second call: continue the run, cosine stretched to RESUME_STEPS
    time python3 -m mlx_dflash.cli train --model "$MODEL" --data "${DATA_DIRS[@]}" --out $RUN --resume \
      --steps "$RESUME_STEPS" --time-budget "${TRAIN_SECONDS:-400}" 2>&1 | quiet | tail -4
  else
    INIT_ARGS=(--layers "${LAYERS:-5}"); [ -n "${INIT:-}" ] && INIT_ARGS=(--init "$INIT")
    [ -n "${HELD_OUT:-}" ] && INIT_ARGS+=(--held-out-from "$W/$HELD_OUT")
    rm -rf $RUN
    LAUNCH=()  # mlx.launch's entry point (MLX is staged without its console scripts); NVLink multicast stays off
    [ "${GPUS:-1}" -gt 1 ] && LAUNCH=(python3 -c "from mlx._distributed_utils.launch import main; main()"
                                      -n "$GPUS" --env NCCL_NVLS_ENABLE=0 --)
    time "${LAUNCH[@]}" python3 -m mlx_dflash.cli train --model "$MODEL" --data "${DATA_DIRS[@]}" --out $RUN "${INIT_ARGS[@]}" \
      --steps 100000 --batch-size 32 --anchors 128 --max-len 768 --eval-every 0 --eval-prompts 16 --lr "${LR:-6e-4}" \
      --save-every 1000 --draft-vocab "${VOCAB:-8192}" --time-budget "${TRAIN_SECONDS:-480}" 2>&1 | quiet | tail -8
  fi
  rm -rf $SHIP
  # shipped forms: 8-bit (ships) and bfloat16 (for bench_gpu.sh and the acceptance without
  # quantization); both come back with the training plot and history, in <=15 MB pieces (files
  # back are capped at 16 MB, 8 a call)
  python3 -c "
import mlx.core as mx; from mlx_dflash.draft import load_draft, save_draft
save_draft(load_draft('$RUN/draft', dtype=mx.bfloat16), '$SHIP/bf16')"
  python3 -m mlx_dflash.cli quantize $SHIP/bf16 $SHIP/q8 --bits 8
  du -sh $SHIP/*
  cp $RUN/training.png $RUN/history.json $SHIP/
  tar cf - -C $SHIP q8 bf16 training.png history.json | split -b 15M - "$OUT"/$(basename $RUN).tar.part.
fi
ls -la "$OUT"
