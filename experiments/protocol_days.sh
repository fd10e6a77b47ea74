#!/bin/bash
# #5's one-day protocol on each H200 day that ran it (sessions 21-26): fit the day's 1-4-job runs,
# validate on its held-out 8- and 16-job runs, one line per day. No GPU: the runs are committed.
#   bash experiments/protocol_days.sh [runs|extrapolate] [OUT_DIR]
# (the first argument is nodus fit --term-selection, default runs; the profiles and reports land in
# OUT_DIR, a new temporary folder by default). It runs this checkout's code whatever nodus is installed.
set -euo pipefail
SEL=${1:-runs}; R=${2:-$(mktemp -d /tmp/protocol-days-XXXXXX)}; mkdir -p "$R"; R=$(realpath "$R")
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nodus() { python -m nodus.cli "$@"; }
for day in 21 22 23 24 25 26; do
  S=experiments/results/h200/session$day/arms
  case $day in
    21) FIT="$S/dedicated-cg-j4-s1 $S/shared-sync+mps-cg-lowpri-j2-s1 $S/overlap+mps-cg-lowpri-j2-s1 $S/shared-sync+mps-cg-lowpri-j4-s1 $S/overlap+mps-cg-lowpri-j4-s1"
        HELD=$(ls -d $S/*/ | grep -v 'j2-s1\|j4-s1');;
    22) FIT="$S/dedicated-cg-ls8-j4-s1 $S/shared-sync+mps-cg-ls8-lowpri-j2-s1 $S/overlap+mps-cg-ls8-lowpri-j2-s1 $S/shared-sync+mps-cg-ls8-lowpri-j4-s1 $S/overlap+mps-cg-ls8-lowpri-j4-s1"
        HELD=$(ls -d $S/*/ | grep -v 'j2-s1\|j4-s1');;
    # session 23: the 16-slot runs (another engine) are not held out
    23) FIT="$S/dedicated-cg-gm512-ls8-j4-s1 $S/overlap-cg-gm512-ls8-j4-s1 $S/shared-sync+mps-cg-gm512-ls8-lowpri-j2-s1 $S/overlap+mps-cg-gm512-ls8-lowpri-j2-s1 $S/shared-sync+mps-cg-gm512-ls8-lowpri-j4-s1 $S/overlap+mps-cg-gm512-ls8-lowpri-j4-s1"
        HELD=$(ls -d $S/*/ | grep -v 'j2-s1\|j4-s1\|ls16\|gm512-lowpri-j16-s1');;
    # session 24: the packed-trainer runs (sp4) are left out here: this base has no packed-attention term
    24) FIT="$S/dedicated-cg-gm512-ls8-j4-s1 $S/overlap-cg-gm512-ls8-j4-s1 $(ls -d $S/*mps*-j2-s* $S/*mps*-j4-s* | tr '\n' ' ')"
        HELD=$(ls -d $S/*/ | grep -v 'j2-s\|j4-s\|sp4');;
    # sessions 25-26: day 24's fit set; the dedicated run repeated later in the day (A/A, -r2) is in neither set
    25|26) FIT="$S/dedicated-cg-gm512-ls8-j4-s1 $S/overlap-cg-gm512-ls8-j4-s1 $(ls -d $S/*mps*-j2-s* $S/*mps*-j4-s* | tr '\n' ' ')"
        HELD=$(ls -d $S/*/ | grep -v 'j2-s\|j4-s\|j4-r2');;
  esac
  rm -rf "$R/p$day.json" "$R/v$day"
  nodus fit $FIT --base h200-xeon16-20261130-qwen3-0.6b --trainer-mode graphed --lora-kernels tuned \
    --graphless-from calibration/data/h200_calibrate_2026-12-01.json --term-selection "$SEL" \
    --out "$R/p$day.json" > "$R/fit$day.log" 2>&1 || { tail -5 "$R/fit$day.log"; exit 1; }
  nodus validate $HELD --profile "$R/p$day.json" --out "$R/v$day" > "$R/val$day.log" 2>&1 \
    || { tail -5 "$R/val$day.log"; exit 1; }
  python - "$R" "$day" <<'PY'
import json, sys
R, day = sys.argv[1:]
d = json.load(open(f"{R}/v{day}/validation.json"))
h, c = d["heldout_replay"], d["heldout_per_config"]["replay"]
fit = [line for line in open(f"{R}/fit{day}.log") if line.startswith("fitted")][0]
print(f"session {day}: per run {h['mape']:.1%} worst {h['worst']:.1%} bias {h['bias']:+.1%} tau {h['kendall_tau']:.2f}"
      f" | per configuration {c['mape']:.1%} worst {c['worst']:.1%} bias {c['bias']:+.1%} tau {c['kendall_tau']:.2f}"
      f" | train {fit.split('train =')[1].split('(fit')[0].strip()}")
PY
done
echo "profiles and reports: $R"
