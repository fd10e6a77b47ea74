#!/usr/bin/env bash
# The paper table (experiments/results/paper_table_gpu.{md,json,png}): every day's runs since session 33,
# each stacks day simulated on the stacks profile of its time, the notes from
# experiments/results/paper_table_gpu_notes.json. A session adds its day folders (and --run-profile)
# here and its note there, then runs: bash experiments/paper_table_gpu.sh
set -e
cd "$(git rev-parse --show-toplevel)"
R=experiments/results/h200
P3=calibration/profiles/h200-xeon16-graphed-stacks-audit-sessions30-33-qwen3-0.6b.json
P4=calibration/profiles/h200-xeon16-graphed-stacks-audit-sessions30-34-qwen3-0.6b.json
P5=calibration/profiles/h200-xeon16-graphed-stacks-audit-sessions30-35-qwen3-0.6b.json
P6=calibration/profiles/h200-xeon16-graphed-stacks-audit-sessions30-36-qwen3-0.6b.json
P8=calibration/profiles/h200-xeon16-graphed-stacks-audit-sessions30-38-qwen3-0.6b.json
mapfile -t NOTES < <(python3 -c "import json; [print(n) for n in json.load(open('experiments/results/paper_table_gpu_notes.json'))]")
ARGS=(); for n in "${NOTES[@]}"; do ARGS+=(--note "$n"); done
PYTHONPATH=. python experiments/gpu_table.py $R/session3{3,4,5,6,7,8,9}/arms/*/ $R/session38/session38-m1/arms/*/ \
  $R/session39/session39-m2/arms/*/ $R/session40/arms/*/ $R/session40/session40-m2/arms/*/ $R/session41/arms/*/ \
  $R/session41/session41-m2/arms/*/ $R/session42/arms/*/ $R/session42/session42-m2/arms/*/ $R/session43/arms/*/ $R/session43/session43-late/arms/*/ \
  $R/session44/arms/*/ $R/session44/session44-m1/arms/*/ $R/session44/session44-m3/arms/*/ \
  $R/session45/arms/*/ $R/session45/session45-m2/arms/*/ $R/session49/arms/*/ $R/session71/arms/*/ \
  --out experiments/results/paper_table_gpu --profile calibration/profiles/h200-xeon16-graphed-qwen3-0.6b.json \
  --run-profile "$R/session33/arms/shared-sync+mps=$P3" --run-profile "$R/session34/arms/shared-sync+mps=$P3" \
  --run-profile "$R/session35/arms/shared-sync+mps=$P4" --run-profile "$R/session36/arms/shared-sync+mps=$P5" \
  --run-profile "$R/session37/arms/shared-sync+mps=$P6" --run-profile "$R/session38/arms/shared-sync+mps=$P6" \
  --run-profile "$R/session38/session38-m1/arms/shared-sync+mps=$P6" --run-profile "$R/session39/arms/shared-sync+mps=$P8" \
  --run-profile "$R/session39/session39-m2/arms/=$P8" \
  --run-profile "$R/session40/arms/shared-sync+mps=$P8" --run-profile "$R/session40/session40-m2/arms/=$P8" \
  --run-profile "$R/session41/arms/shared-sync+mps=$P8" --run-profile "$R/session41/session41-m2/arms/=$P8" \
  --run-profile "$R/session42/arms/shared-sync+mps=$P8" --run-profile "$R/session43/arms/shared-sync+mps=$P8" \
  --run-profile "$R/session44/arms/shared-sync+mps=$P8" --run-profile "$R/session45/arms/shared-sync+mps=$P8" \
  --run-profile "$R/session49/arms/shared-sync+mps=$P8" --run-profile "$R/session71/arms/shared-sync+mps=$P8" \
  --learning $R/session34/learning-gate/compare-3seeds-aa.json \
  --timelines "1=shared-sync/mps/g1/k2+mb8k+sp4+lowpri+cg+cpu2+ecpu4+gm512+lk+@session39,shared-sync/mps/g1/k2+off+mb8k+sp4+lowpri+cg+cpu2+ecpu4+gm512+lk+@session39" \
  "${ARGS[@]}"
