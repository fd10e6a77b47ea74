#!/bin/bash
# One H200 call after the vLLM bundle is staged (see ../shared/device/README.md):
#   bash experiments/device_session.sh trainer|arms|calibrate|engine
# Writes at most 8 files under $OUT (the device returns no more): logs, JSON, a tarball of run folders.
set -uo pipefail
export PYTHONPATH=/opt/nodus-site:. VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
export NODUS_COMMIT=$(cat .device_commit 2>/dev/null || echo unknown)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# A Qwen3-0.6B-shaped model with saved random weights (engine and trainer load the same ones).
random_model() {
  python -c "from pathlib import Path; from experiments.gpu_arms import make_random_model; make_random_model(Path('/tmp/nodus-qwen3-0.6b-random'), 'qwen3-0.6b')"
}
case "${1:-arms}" in
  trainer)
    timeout 300 python experiments/bench_trainer.py --out "$OUT/bench_trainer_h200.json" --no-loop --iters 2 \
      --mb-tokens 16384 32768 > "$OUT/bench_trainer.log" 2>&1; echo "bench_trainer rc=$?" ;;
  calibrate)
    random_model
    timeout 420 python -m nodus.cli calibrate --model /tmp/nodus-qwen3-0.6b-random --out "$OUT/h200-calibrated.json" \
      > "$OUT/calibrate.log" 2>&1; echo "calibrate rc=$?" ;;
  engine)
    random_model
    timeout 400 python experiments/bench_engine_loop.py --model /tmp/nodus-qwen3-0.6b-random --batch 512 --adapters 8 \
      --out "$OUT/engine_loop_h200.json" > "$OUT/engine_loop.log" 2>&1; echo "engine_loop rc=$?" ;;
  arms)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
    timeout "${ARMS_TIMEOUT:-540}" python experiments/gpu_arms.py --out /tmp/arms --jobs "${JOBS:-8}" --steps "${STEPS:-4}" \
      --seeds "${SEEDS:-1}" --arms "${ARMS:-dedicated,shared-sync,overlap,overlap+mps}" ${ARMS_EXTRA:-} > "$OUT/arms.log" 2>&1
    echo "gpu_arms rc=$?"
    cp /tmp/arms/arms.json "$OUT/" 2>/dev/null
    tar czf "$OUT/arms_runs.tgz" -C /tmp arms 2>/dev/null ;;
esac
grep -v " INFO \| WARNING \|it/s\]" "$OUT"/*.log | tail -25
