#!/usr/bin/env bash
# #5's protocol on session 70's H100 day, one stack: what built the shipped
# h100-xeon16-graphed-calibrated-onestack-floor-session70-qwen3-0.6b and its validation report (session 71).
# Session 70's first profile, h100-xeon16-graphed-calibrated-onestack-session70-qwen3-0.6b (report
# validation-h100-onestack-session70.md), is this without --step-floor in step 3.
# Run from the repository root: bash experiments/results/h100/session70/protocol.sh WORKDIR
set -euo pipefail
W=${1:?a new work folder}; mkdir "$W"
D=experiments/results/h100/session70; S=$D/h100/arms; R=experiments/results/h200
N=h100-xeon16-graphed-calibrated-onestack-floor-session70-qwen3-0.6b
# 1. The calibration's train points with the mode each was timed in, as calibrate.log shows them
#    (the capture failed between the 4096 x 8 and 16384 x 8 points; calibrate records this itself since b4fc9c0).
#    Its header's driver, which nodus calibrate did not record before this session, from the same
#    machine's nvidia-smi (h100/gpu.txt).
python - "$D/calibrate/h100-calibrated.json" "$W/h100-calibrated-tagged.json" "$D/h100/gpu.txt" <<'P'
import json, sys
prof = json.load(open(sys.argv[1]))
gpu, driver = open(sys.argv[3]).read().strip().rsplit(", ", 1)
assert gpu == prof["environment"]["gpu"]
prof["environment"]["driver"] = driver
raw = prof["measurements"]["calibrate"]
assert [(t["tokens"], t["adapters"]) for t in raw["train"]] == [(4096, 1), (16384, 1), (4096, 8), (16384, 8)]
for t, mode in zip(raw["train"], ["graphed", "graphed", "graphed", "eager"]):
    t["step_mode"] = mode
raw["train_kl"]["step_mode"] = "eager"
raw["trainer"]["step_mode_asked"] = "graphed"
json.dump(prof, open(sys.argv[2], "w"), indent=1)
P
nodus calibrate --from-raw "$W/h100-calibrated-tagged.json" --out "$W/h100-cal70.json"
# 2. The audit term (one response a prompt audited), from the pairs the stacks profile took it from.
A=shared-sync+mps-cg-gm512-lowpri-cpu2-ecpu4
nodus fit-audit $R/session32/arms/$A-sp4-k2-mb8k-j16-s1 $R/session32/arms/$A-audr1-sp4-k2-mb8k-j16-s1 \
  $R/session32/arms/$A-sp4-k2-mb8k-s1 $R/session32/arms/$A-audr1-sp4-k2-mb8k-s1 \
  $R/session33/arms/$A-sp4-k2-mb8k-s{1,2,3} $R/session33/arms/$A-audr1-sp4-k2-mb8k-s{1,2,3} \
  --base "$W/h100-cal70.json" --out "$W/h0.json"
# 3. This day's seven runs of 1-4 jobs: train and publish terms, the engine's scale and per-step host floor
#    (fitted together on the lone generations: the dedicated runs' 64 sequences, shared-sync's 256), the pair's rates.
nodus fit $S/*/ --base "$W/h0.json" --out "$W/h1.json" --step-floor
# 4. Held out: session 69's one-stack runs of 8 jobs (another day, another machine).
nodus validate experiments/results/h100/session69/h100/arms/*/ $S/*/ --profile "$W/h1.json" \
  --annotate "$W/$N.json" --report-path calibration/reports/validation-h100-onestack-floor-session70.md --out "$W/validation"
