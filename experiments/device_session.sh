#!/bin/bash
# One H200 call after the vLLM bundle is staged (see ../shared/device/README.md):
#   bash experiments/device_session.sh MODE
#   (MODE: trainer|graphs|tune-lora|arms|calibrate|sharing|engines|engine|engine-profile|publish|handoff|arrivals|learn|
#    small-base|trainer-memory)
# trainer-memory needs no bundle (torch, transformers and numpy are in the device image); every other
# mode stops at once, exit 3, on a machine where the bundle is not installed (a fresh machine: the
# device may hand one back and start another between calls).
# Writes at most 8 files under $OUT (the device returns no more): logs, JSON, a tarball of run folders,
# and the compile cache (1-3 of the 8: with several TAG invocations in a call, mind the count).
set -uo pipefail
export PYTHONPATH=/opt/nodus-site:. VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
export NODUS_COMMIT=$(cat .device_commit 2>/dev/null || echo unknown)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${1:-arms}" != trainer-memory ] && ! python -c "import vllm, pydantic, simpy" 2> /dev/null; then
  # Session 49: a call after the machine had been swapped for a fresh one failed deep in gpu_arms
  # ("No module named 'pydantic'") after 2 s; this names the cause.
  echo "device_session: vLLM, pydantic or simpy does not import here (PYTHONPATH=$PYTHONPATH): the bundle is not" \
       "installed on this machine, a fresh one if an earlier call staged it. Stage .device/vllm-1 .. -N first" \
       "(bash .device/vllm-K/stage.sh, one part a call); trainer-memory needs no bundle." >&2
  exit 3
fi
# vLLM's torch.compile cache from an earlier session (an engine starts in ~45 s with it, ~80 s
# without; a new configuration's key compiles for ~55 s). Carry the folder .device/cache holding
# the last call's cache as it came back (vllm-cache.tgz, or its parts vllm-cache.tgz.part0, part1,
# ...; keep one cache there), or the older single file .device/vllm-cache.tgz. The folder wins. A
# cache that does not unpack whole (a part missing or cut) is not used. Each call sends the cache
# back: one file under 15 MB, else 15 MB parts up to 45 MB (the device returns 16 MiB a file;
# session 31's cache with a one-stack and a two-stack key was over 15 MB and came back in none).
restore_cache() {  # $@: the cache's files, in order
  rm -rf /tmp/vllm-cache-in && mkdir -p /tmp/vllm-cache-in ~/.cache
  if cat "$@" | tar xz -C /tmp/vllm-cache-in 2> /dev/null && [ -d /tmp/vllm-cache-in/vllm/torch_compile_cache ]; then
    mkdir -p ~/.cache/vllm && mv /tmp/vllm-cache-in/vllm/torch_compile_cache ~/.cache/vllm/ \
      && echo "vLLM compile cache restored ($*)"
  else
    echo "vLLM compile cache in $* does not unpack whole: not used"
  fi
  rm -rf /tmp/vllm-cache-in
}
if [ ! -d ~/.cache/vllm/torch_compile_cache ]; then
  if ls .device/cache/vllm-cache.tgz.part? > /dev/null 2>&1; then
    restore_cache .device/cache/vllm-cache.tgz.part?
  elif [ -f .device/cache/vllm-cache.tgz ]; then
    restore_cache .device/cache/vllm-cache.tgz
  elif [ -f .device/vllm-cache.tgz ]; then
    restore_cache .device/vllm-cache.tgz
  fi
fi
save_cache() {
  # SAVE_CACHE=0: another invocation running beside this one (the other GPU) offers it.
  [ "${SAVE_CACHE:-1}" = 1 ] || return 0
  if [ -d ~/.cache/vllm/torch_compile_cache ]; then
    if ! tar czf /tmp/vllm-cache.tgz -C ~/.cache vllm/torch_compile_cache 2> /dev/null; then
      echo "vLLM compile cache: tar failed, not sent back"; return 0
    fi
    local size; size=$(stat -c %s /tmp/vllm-cache.tgz)
    if [ "$size" -lt 15000000 ]; then
      cp /tmp/vllm-cache.tgz "$OUT/"
    elif [ "$size" -lt 45000000 ]; then
      split -b 15000000 -d -a 1 /tmp/vllm-cache.tgz "$OUT/vllm-cache.tgz.part"
    else
      echo "vLLM compile cache: $size bytes, over 45 MB: not sent back"
    fi
  fi
}
trap save_cache EXIT
# The two monitors a real run keeps (nodus.gpumon, nodus.hostmon), each sampled for 1 s here so a
# call shows at once whether they work on this machine (NVML found, the run's CPUs listed in
# /proc/stat, a cgroup with throttling counters): written to $OUT/monitors.txt by the arms and
# learn modes.
monitor_check() {
  python - > "$OUT/monitors.txt" 2>&1 <<'PY'
import json, time
from nodus.gpumon import GpuMonitor
from nodus.hostmon import HostMonitor
g, h = GpuMonitor(1).start(), HostMonitor(interval_s=0.2).start()
time.sleep(1.0)
print("gpu_monitor", json.dumps(g.stop()))
print("host_monitor", json.dumps(h.stop()))
PY
  echo "monitors: $(grep -o '"available": [a-z]*' "$OUT/monitors.txt" | tr '\n' ' ')$(grep -o '"cpu_lines": "[a-z]*"' "$OUT/monitors.txt")"
}
# A Qwen3-0.6B-shaped model with saved random weights (engine and trainer load the same ones).
random_model() {
  python -c "from pathlib import Path; from experiments.gpu_arms import make_random_model; make_random_model(Path('/tmp/nodus-qwen3-0.6b-random'), 'qwen3-0.6b')"
}
# The 25M small base trained on this GPU into /tmp/small-base (its per-family sampled accuracy,
# small_base.json, is the check).
small_base() {
  rm -rf /tmp/small-base
  timeout "${SMALL_BASE_TIMEOUT:-240}" python experiments/train_base.py --size small --device cuda \
    --out /tmp/small-base > "$OUT/small_base.log" 2>&1
  echo "small_base rc=$?"
  cp /tmp/small-base/base_model.json "$OUT/small_base.json" 2>/dev/null
}
case "${1:-arms}" in
  trainer)
    # Both multi-adapter layouts on the reference workload's long-tailed lengths (8 jobs x 64
    # sequences, prompt 140, responses lognormal median 100, <= 256 new tokens).
    timeout "${TRAINER_TIMEOUT:-300}" python experiments/bench_trainer.py --out "$OUT/bench_trainer_h200.json" \
      --no-loop --no-peft --iters 2 --lengths longtail --prompt-tokens 140 --seq-tokens 396 \
      --layouts "${LAYOUTS:-padded,masked,auto}" --mb-tokens ${MB_TOKENS:-16384 32768} ${TRAINER_EXTRA:-} > "$OUT/bench_trainer.log" 2>&1
    echo "bench_trainer rc=$?" ;;
  graphs)
    # The trainer's step eager against CUDA-graphed, on a recorded run's rows (jobs per train step
    # of a dedicated run, an 8-job overlap group and a 16-job one): speed, memory, agreement;
    # GRAPHS_EXTRA=--profile adds where each step's GPU time goes (top kernels).
    timeout "${GRAPHS_TIMEOUT:-300}" python experiments/bench_graphs.py --out "$OUT/bench_graphs_h200.json" \
      --lengths-from "${GRAPHS_RUN:-experiments/results/h200/session8/arms/overlap+mps-s1}" \
      --jobs "${GRAPHS_JOBS:-4,1,8}" --iters "${GRAPHS_ITERS:-3}" ${GRAPHS_EXTRA:-} > "$OUT/bench_graphs.log" 2>&1
    echo "bench_graphs rc=$?"; tail -30 "$OUT/bench_graphs.log" ;;
  tune-lora)
    # vLLM's multi-LoRA Triton kernels tuned for this GPU and the Qwen3-0.6B shape (102 s of tuning
    # in session 11 with TUNE_EXTRA="--batches 1,16,64,256,512,8192"). Engines use the shipped
    # real/lora_configs by default on an H200; a new folder stays in /tmp while the machine is held,
    # and a later call's arms try it with ARMS_EXTRA="--engine-env VLLM_TUNED_CONFIG_FOLDER=/tmp/lora-configs"
    # (run keys -ee); copy its files into real/lora_configs to ship them.
    timeout "${TUNE_TIMEOUT:-420}" python experiments/tune_lora_kernels.py --out /tmp/lora-configs \
      --report "$OUT/tune_lora_h200.json" --budget-s "${TUNE_BUDGET:-360}" ${TUNE_EXTRA:-} > "$OUT/tune_lora.log" 2>&1
    echo "tune_lora rc=$?"; cp /tmp/lora-configs/*.json "$OUT/" 2>/dev/null; tail -5 "$OUT/tune_lora.log" ;;
  calibrate)
    # CAL_EXTRA=--trainer-graphs: the graphed trainer's terms (train.step_mode graphed); the profile
    # also stays in /tmp, so a later `sharing` call on the warm machine can take it as its base
    # (SHARING_BASE=/tmp/h200-calibrated.json: the co-run rates then are the graphed trainer's).
    random_model
    rm -f /tmp/h200-calibrated.json
    timeout "${CAL_TIMEOUT:-420}" python -m nodus.cli calibrate --model /tmp/nodus-qwen3-0.6b-random --out /tmp/h200-calibrated.json \
      ${CAL_EXTRA:-} > "$OUT/calibrate.log" 2>&1; echo "calibrate rc=$?"; cp /tmp/h200-calibrated.json "$OUT/" 2>/dev/null ;;
  sharing)
    # Engine and trainer as two processes, alone and co-running, without and with MPS (the full
    # grid took over 500 s on the 16-core host in session 7: narrow it with SHARING_EXTRA, e.g.
    # "--batches 64,256 --repeats 1"). The raw timings reach $OUT/h200-sharing.raw.json after every
    # bucket, so a call that runs out of time still returns them (nodus calibrate-sharing --from-raw).
    random_model
    timeout "${SHARING_TIMEOUT:-480}" python -m nodus.cli calibrate-sharing --model /tmp/nodus-qwen3-0.6b-random \
      --base "${SHARING_BASE:-h200-xeon16-qwen3-0.6b}" --out "$OUT/h200-sharing.json" ${SHARING_EXTRA:-} > "$OUT/sharing.log" 2>&1
    echo "calibrate-sharing rc=$?" ;;
  engines)
    # Two stacks' engines generating at once by engine size (nodus calibrate-engines: each engine alone,
    # beside the other and beside the other stack's trainer, 64-512 sequences over one adapter per 64)
    # on ENGINES_BASE (default #5's protocol profile: its LoRA kernels, CUDA-graph size and trainer mode,
    # and its fitted rates kept at the fit's engine size). The raw timings reach $OUT/engines.raw.json
    # after every bucket (nodus calibrate-engines --from-raw builds the profile from them).
    # ENGINES_EXTRA="--batches 128,256,512" skips the smallest size (the protocol fit's is 128).
    random_model
    timeout "${ENGINES_TIMEOUT:-520}" python -m nodus.cli calibrate-engines --model /tmp/nodus-qwen3-0.6b-random \
      --base "${ENGINES_BASE:-calibration/profiles/h200-xeon16-graphed-stacks-audit-decode31-38-j2j4phases4-session35-qwen3-0.6b.json}" \
      --out "$OUT/engines.json" ${ENGINES_EXTRA:-} > "$OUT/engines.log" 2>&1
    echo "calibrate-engines rc=$?"; tail -8 "$OUT/engines.log" ;;
  engine)
    random_model
    timeout 400 python experiments/bench_engine_loop.py --model /tmp/nodus-qwen3-0.6b-random --batch 512 --adapters 8 \
      --out "$OUT/engine_loop_h200.json" > "$OUT/engine_loop.log" 2>&1; echo "engine_loop rc=$?" ;;
  publish)
    # Where a publish's time goes: 4 adapters (an 8-job overlap group) published pinned and
    # unpinned, alone and beside a GPU load at below-normal MPS priority (bench_publish.py).
    random_model
    # Every thread's stack 20 s before the limit: a part that hangs says where (session 18's did not).
    timeout "${PUB_TIMEOUT:-300}" python experiments/bench_publish.py --model /tmp/nodus-qwen3-0.6b-random \
      --jobs "${PUB_JOBS:-4}" --versions "${PUB_VERSIONS:-6}" --beside --out "$OUT/publish_h200.json" \
      --dump-stacks-after $(( ${PUB_TIMEOUT:-300} > 40 ? ${PUB_TIMEOUT:-300} - 20 : ${PUB_TIMEOUT:-300} / 2 + 1 )) \
      > "$OUT/publish.log" 2>&1
    echo "bench_publish rc=$?"; grep -v " INFO \| WARNING \|it/s\]" "$OUT/publish.log" | tail -60 ;;
  handoff)
    # Both sides of a step's adapter handoff, PEFT safetensors folders against the flat file
    # (bench_handoff.py): the trainer's save of 4 adapters from the GPU, the engine's publish of them.
    random_model
    timeout "${HO_TIMEOUT:-300}" python experiments/bench_handoff.py --model /tmp/nodus-qwen3-0.6b-random \
      --jobs "${HO_JOBS:-4}" --versions "${HO_VERSIONS:-20}" --out "$OUT/handoff_h200.json" > "$OUT/handoff.log" 2>&1
    echo "bench_handoff rc=$?"; grep -v " INFO \| WARNING \|it/s\]" "$OUT/handoff.log" | tail -40 ;;
  arrivals)
    # Jobs that arrive over time (jobs[].arrive_s) on the real backend: JOBS jobs (8), one every
    # ARRIVE_EVERY s (5), STEPS steps (10), ARR_POLICY (continuous) under MPS with the graphed
    # trainer, random Qwen3-0.6B-shape weights and synthetic rollouts, no baseline; then the
    # simulator's prediction of the recorded config on ARR_PROFILE. Back: arrivals.tgz (the run
    # folder, its log, sim.json). Run it as a session's first arms call would be (CPU checked:
    # 3 jobs on the tiny model, sharing none: the late jobs waited 0.003 and 0.38 s to join, the
    # second behind a CPU engine step with the first's 64 prompts in it; 0.00 s in the simulator).
    random_model
    D=$(mktemp -d /tmp/arrivals-XXXXXX)
    timeout "${ARR_TIMEOUT:-400}" python -m nodus.cli run --backend real --model /tmp/nodus-qwen3-0.6b-random \
      --mode synthetic --jobs "${JOBS:-8}" --policy "${ARR_POLICY:-continuous}" --arrive-every "${ARRIVE_EVERY:-5}" \
      --steps "${STEPS:-10}" --trainer-graphs --trainer-priority below-normal --no-baseline --out "$D/run" \
      ${ARR_EXTRA:-} > "$D/arrivals.log" 2>&1
    echo "arrivals rc=$?"; grep "^|" "$D/arrivals.log" | tail -16
    python -m nodus.cli sim "$D/run/config.json" --profile "${ARR_PROFILE:-h200-xeon16-graphed-session16-qwen3-0.6b}" \
      --json > "$D/sim.json" 2>> "$D/arrivals.log"; echo "sim rc=$?"
    tar czf "$OUT/arrivals.tgz" -C "$D" . ;;
  engine-profile)
    # Is the shared generation GPU- or host-bound? A recorded step's generation timed per engine
    # step, under torch.profiler (kernel time against the wall) and cProfile (the host's time).
    random_model
    timeout "${EP_TIMEOUT:-400}" python experiments/bench_engine_profile.py --model /tmp/nodus-qwen3-0.6b-random \
      --run "${EP_RUN:-experiments/results/h200/session14/arms/shared-sync+mps-cg-s1}" \
      --out "$OUT/engine_profile_h200.json" ${EP_EXTRA:-} > "$OUT/engine_profile.log" 2>&1
    echo "engine_profile rc=$?"; grep -v " INFO \| WARNING \|it/s\]" "$OUT/engine_profile.log" | tail -70 ;;
  arms)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
    monitor_check
    # A fresh folder per invocation: a warm machine keeps /tmp between calls. Never time two
    # invocations side by side, even on two GPUs of one host: the phases are host-bound in part,
    # and session 4's side-by-side runs measured half the throughput (results/h200/session4).
    D=$(mktemp -d /tmp/arms-XXXXXX); mkdir -p "$D/arms"
    # TAG names this invocation's one output file (the device returns 8 files a call), so one
    # call can run several invocations one after another: arms_runs$TAG.tgz holds arms.json,
    # arms.log and the runs.
    T=${TAG:-}
    # --deadline: a run whose estimate would end past the limit is skipped, not begun (session 31's
    # limit stopped two runs while their processes started: 240 s of 1800 spent on nothing). 30 s
    # of the limit are left for what the invocation does before its first run and after its last
    # (the model's save, closing the processes, the environment record).
    # Plan a call first, on the CPU machine: gpu_arms.py --plan --cpus 16 with the same arms.
    # --estimates: the starts and run factors measured by earlier calls on this machine (a fresh
    # machine has none: the H200 defaults), so a call on a warm machine is planned by its own figures.
    # ESTIMATES_SEED=FILE (e.g. experiments/results/h200/session44/estimates.json, the slowest of its three machines, with
    # the compile cache staged): the figures a machine with none of its own starts from.
    EST=~/.cache/nodus/gpu_arms_estimates.json
    # A seed named but absent stops the call: without it a fresh machine plans on the H200 defaults
    # and skips runs they overprice (session 45: a seed left out of the carried tree, 504 s priced
    # for a two-stack start that takes 256-306 s).
    if [ -n "${ESTIMATES_SEED:-}" ] && [ ! -f "$ESTIMATES_SEED" ]; then
      echo "ESTIMATES_SEED=$ESTIMATES_SEED: no such file in the carried tree" \
        "(device_parts.py light keeps */estimates.json)"
      exit 2
    fi
    if [ ! -f "$EST" ] && [ -n "${ESTIMATES_SEED:-}" ]; then
      mkdir -p ~/.cache/nodus && cp "$ESTIMATES_SEED" "$EST" && echo "estimates seeded from $ESTIMATES_SEED"
    fi
    # --shrink-to-fit unless SHRINK_TO_FIT=0: the device lends an H100 or an H200 for the same call,
    # and an arm whose graphed trainers would not fit runs at the micro-batch that does (its run key
    # names it) instead of being skipped (session 72: two calls' runs skipped on an H100, ~100 s).
    SHRINK=$([ "${SHRINK_TO_FIT:-1}" = 0 ] || echo --shrink-to-fit)
    timeout "${ARMS_TIMEOUT:-540}" python experiments/gpu_arms.py --out "$D/arms" --jobs "${JOBS:-8}" --steps "${STEPS:-5}" \
      ${SEEDS:+--seeds "$SEEDS"} --arms "${ARMS:-dedicated,shared-sync,overlap,overlap+mps}" \
      --deadline $(( ${ARMS_TIMEOUT:-540} > 60 ? ${ARMS_TIMEOUT:-540} - 30 : ${ARMS_TIMEOUT:-540} / 2 )) \
      --estimates "$EST" $SHRINK ${ARMS_EXTRA:-} > "$D/arms/arms.log" 2>&1
    MODE_RC=$?; echo "gpu_arms$T rc=$MODE_RC"
    grep "^note: \|steps/GPU-h\|skipped\|Error\|error:" "$D/arms/arms.log" | tail -12
    tar czf "$OUT/arms_runs$T.tgz" -C "$D" arms 2>/dev/null ;;
  trainer-memory)
    # The graphed trainer's memory at each micro-batch size (experiments/trainer_memory.py: the
    # backend's own warm-up of one stack of the reference workload, a process a size): what the fit
    # check (real.backend.trainer_gib_estimate) prices. No bundle needed. MB_TOKENS: the sizes.
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
    timeout "${TM_TIMEOUT:-300}" python experiments/trainer_memory.py --mb-tokens "${MB_TOKENS:-4096,8192,16384}" \
      --timeout "${TM_SIZE_TIMEOUT:-95}" --out "$OUT/trainer_memory.json" ${TM_EXTRA:-} > "$OUT/trainer_memory.log" 2>&1
    echo "trainer_memory rc=$?"; tail -4 "$OUT/trainer_memory.log" ;;
  small-base)
    # The 25M small base for GPU learning runs (~2.5 min); a later call on the warm machine learns
    # on it with LEARN_MODEL=/tmp/small-base (the folder stays while the machine is held).
    small_base ;;
  learn)
    # Equal learning: the project's tiny base (carried in .device/tiny-base), 8 jobs (one per task
    # family) x 20 steps, dedicated (twice: A/A) against overlap+MPS, 2 seeds; then the small base
    # trained on this GPU (its per-family sampled accuracy is the check). No priming step: these
    # runs measure learning (eager engine and trainer, nothing to compile), and a primed run
    # would also evaluate every job.
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
    monitor_check
    D=$(mktemp -d /tmp/learn-XXXXXX)
    T=${TAG:-}
    timeout "${LEARN_TIMEOUT:-330}" python experiments/gpu_arms.py --out "$D/learn" --mode tasks \
      --model-dir "${LEARN_MODEL:-.device/tiny-base}" --enforce-eager --jobs 8 --steps "${STEPS:-20}" \
      --seeds "${SEEDS:-1,2}" --arms dedicated,overlap+mps ${LEARN_AA---aa} --max-new-tokens 80 --no-prime \
      --job-fields '{"learning_rate": 1e-3, "prompt_pool": 8}' ${ARMS_EXTRA:-} > "$D/learn.log" 2>&1
    MODE_RC=$?; echo "learn$T rc=$MODE_RC"
    grep "steps/GPU-h\|Error\|error:" "$D/learn.log" | tail -8
    mv "$D/learn.log" "$D/learn/" 2>/dev/null
    tar czf "$OUT/learn_runs$T.tgz" -C "$D" learn 2>/dev/null
    if [ "${SMALL_BASE_TIMEOUT:-240}" -gt 0 ]; then small_base; fi ;;
esac
# The tail of the logs a mode left in $OUT (arms and learn pack theirs into their tarball). The call
# exits with its mode's main command's status (MODE_RC: gpu_arms' in arms, the learning runs' in
# learn; 0 in the modes that record none), not this grep's: with no log here it exited 2, the code
# of a missing ESTIMATES_SEED, after every arms call of sessions 66-67 that ran to the end.
shopt -s nullglob; logs=("$OUT"/*.log); shopt -u nullglob
[ ${#logs[@]} -eq 0 ] || { grep -v " INFO \| WARNING \|it/s\]" "${logs[@]}" | tail -25; } || true
exit "${MODE_RC:-0}"
