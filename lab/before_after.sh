#!/usr/bin/env bash
# Question: does a restructuring of the code change its GPU speed? The same quick benchmarks on a BEFORE tree
# (a copy of the package at an earlier commit, carried to the device) and on the current tree, alternating
# before / after twice in one call, so drift between device calls cannot pose as a difference.
#
# On the device, from the repository root (BEFORE holds the earlier commit's ioattn/ folder):
#   BEFORE=.carry/before bash lab/before_after.sh
# Writes $OUT/before_after.tgz: {before,after}-{decode,prefill,serve}-ROUND.{json,log}.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
BEFORE=${BEFORE:?set BEFORE to the folder holding the earlier ioattn/}
RAW=$(mktemp -d)
SERVE=(--compare ioattn --model llama3-8b-shape --num-requests 96 --input-len 100 1024 --output-len 128
       --decode-batch 0)
run() {  # side round name args...
  local side=$1 round=$2 name=$3 root=.
  shift 3
  [ "$side" = before ] && root=$BEFORE
  echo "== $side $name round $round"
  PYTHONPATH=$root timeout 240 python3 -m ioattn.cli bench "$@" --json "$RAW/$side-$name-$round.json" \
    > "$RAW/$side-$name-$round.log" 2>&1 || echo "   exit $? (see the log)"
  tail -n 3 "$RAW/$side-$name-$round.log"
}
for round in 1 2; do
  for side in before after; do
    run "$side" "$round" decode decode --quick
    run "$side" "$round" prefill prefill --quick
  done
done
for side in before after; do
  run "$side" 1 serve serve "${SERVE[@]}"
done
tar czf "$OUT/before_after.tgz" -C "$RAW" .
