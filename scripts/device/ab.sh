#!/usr/bin/env bash
# A change measured against the tree as committed, in ONE device call: `mlx-dflash bench ARGS`
# with the tree as carried, then with PATCH applied, ROUNDS times in turn (a shared machine
# drifts between calls by as much as a change does). Carry .device/b and the patch's folder
# (e.g. .device/patches, git-ignored); make the patch here with `git diff > .device/patches/X.patch`
# and `git checkout` the files, or to compare with an older commit REV:
# `git diff -R REV -- src ':!src/mlx_dflash/drafts' > .device/patches/X.patch` (while the draft's
# weights are untracked for the lease, a plain diff would carry them and the patch would fail).
# Prints each run's rows and its fixed-block runs' cost per text and per cycle
# (scripts/per_text_overhead.py); $OUT/ab-NAME.tgz holds every result.
#   ROUNDS=2 bash scripts/device/ab.sh .device/patches/X.patch --scale qwen3.5-9b --num-prompts 1 \
#     --replay-mean 6.5 --lengths 1024 --repeats 2
set -uo pipefail
patch_file=$1; shift
source .device/b/env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
R=$(mktemp -d)
run() {  # --out DIR ARGS: the bench, then its per-text fit
  python3 -m mlx_dflash.cli bench "$@" 2>&1 | grep -E '^\| (baseline|dflash|mlx)|rror|^\{"context_len'
  [ -f "$2/results.json" ] && python3 scripts/per_text_overhead.py "$2/results.json" | tail -1
}
for round in $(seq "${ROUNDS:-2}"); do
  echo "== round $round: as committed"; run --out "$R/committed$round" "$@"
  patch -s -p1 < "$patch_file" || exit 1
  echo "== round $round: with $(basename "$patch_file")"; run --out "$R/patched$round" "$@"
  patch -s -R -p1 < "$patch_file"
done
tar czf "$OUT/ab-$(basename "$patch_file" .patch).tgz" -C "$R" .
