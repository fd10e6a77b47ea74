"""Is the shared engine's generation bound by the GPU or by the host? One engine as the arms run it
(CUDA graphs, tuned LoRA kernels, token-id prompts), one generation of a recorded run's step
(every job's forced response lengths and prompt lengths), timed per engine step, then once under
torch.profiler (the GPU's kernel time against the wall) and once under cProfile (where the host's
time goes).

    python experiments/bench_engine_profile.py --model PATH --run RUN_DIR --out OUT.json

Variants (``--variants``): ``audit`` (every response returns its tokens' logprobs, the arms'
default), ``r1`` (the first response of each prompt), ``none`` (no logprobs), and ``ded`` (one
job's requests alone, as a dedicated run generates). Each: one warm-up, then ``--repeats`` timed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import tempfile
import time
from pathlib import Path

from nodus.timeline import read_text

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def recorded_step(run: Path, step: int) -> list[dict]:
    """Each job's generation at ``step`` of a recorded run: prompts, responses a prompt, forced
    response lengths (prompt-major), prompt tokens per prompt."""
    spans = [json.loads(line) for line in read_text(run / "spans.jsonl").splitlines() if line.strip()]
    gens = [s for s in spans if s["phase"] == "generate" and s["attrs"].get("step") == step]
    if not gens:
        raise SystemExit(f"{run}: no generate span at step {step}")
    cfg = json.loads((run / "config.json").read_text())
    jobs = {j["id"]: j for j in cfg["jobs"]}
    out = []
    for s in sorted(gens, key=lambda s: s["job"]):
        job, a = jobs[s["job"]], s["attrs"]
        n = job["responses_per_prompt"]
        out.append({"job": s["job"], "prompts": len(a["response_tokens"]) // n, "n": n,
                    "lengths": a["response_tokens"], "prompt_tokens": a["prompt_tokens"] // len(a["response_tokens"]),
                    "max_new_tokens": job["max_new_tokens"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local model folder with saved weights")
    ap.add_argument("--run", required=True, type=Path, help="a recorded run's folder (spans.jsonl, config.json)")
    ap.add_argument("--step", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--engine-memory", type=float, default=0.4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="audit,r1,none,ded")
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler and cProfile passes")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                    help="an extra vLLM engine argument (repeatable)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import numpy as np
    import torch

    from real.engine import GenRequest, MultiLoRAEngine
    from real.profiling import profile_call
    from real.trainer import MultiLoRATrainer
    from real.workers import load_base_model

    gens = recorded_step(args.run, args.step)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    trainer = MultiLoRATrainer(load_base_model(args.model, "auto", getattr(torch, dtype), device),
                               device=device, base_model_name_or_path=args.model)
    root = tempfile.mkdtemp(prefix="nodus-engprof-")
    for g in gens:
        trainer.add_job(g["job"], rank=16, alpha=32, lr=1e-5, seed=len(g["job"]))
        trainer.save_adapter(g["job"], f"{root}/{g['job']}/v0")
    vocab = trainer.vocab_size
    del trainer
    if device == "cuda":
        torch.cuda.empty_cache()
    extra = {k: json.loads(v) for k, v in (a.split("=", 1) for a in args.engine_arg)}
    if device == "cpu":
        extra.setdefault("max_num_batched_tokens", 65536)
    t0 = time.perf_counter()
    eng = MultiLoRAEngine(args.model, max_loras=len(gens), max_lora_rank=16, max_num_seqs=args.max_num_seqs,
                          gpu_memory_utilization=args.engine_memory, skip_tokenizer_init=True, dtype=dtype, **extra)
    start_s = time.perf_counter() - t0
    for g in gens:
        eng.publish(g["job"], 0, f"{root}/{g['job']}/v0")
    rng = np.random.default_rng(0)
    prompts = {g["job"]: [rng.integers(1, vocab - 1, g["prompt_tokens"]).tolist() for _ in range(g["prompts"])]
               for g in gens}

    def requests(variant: str) -> list[GenRequest]:
        chosen = gens[:1] if variant == "ded" else gens
        return [GenRequest(g["job"], 0, prompts[g["job"]], n=g["n"], max_new_tokens=g["max_new_tokens"],
                           forced_lengths=g["lengths"], logprobs=variant != "none",
                           logprob_responses=1 if variant == "r1" else None) for g in chosen]

    # Every engine step timed: how many a generation takes and how long each is.
    engine = eng.llm.llm_engine
    step_fn, steps = engine.step, []

    def timed_step(*a, **k):
        t = time.perf_counter()
        try:
            return step_fn(*a, **k)
        finally:
            steps.append(time.perf_counter() - t)

    engine.step = timed_step
    results, reqs_of = {}, {}
    for variant in args.variants.split(","):
        reqs = reqs_of[variant] = requests(variant)
        eng.generate(reqs)  # warm-up at this shape (JIT compiles, allocator)
        walls, per_step = [], []
        for _ in range(args.repeats):
            steps.clear()
            t = time.perf_counter()
            eng.generate(reqs)
            walls.append(time.perf_counter() - t)
            per_step.append(list(steps))
        st = np.array(per_step[int(np.argmin(walls))])
        seqs = sum(len(g["lengths"]) for g in (gens[:1] if variant == "ded" else gens))
        results[variant] = {"sequences": seqs, "wall_s": [round(w, 4) for w in walls], "engine_steps": len(st),
                            "step_ms": {"median": round(1e3 * float(np.median(st)), 3),
                                        "mean": round(1e3 * float(st.mean()), 3),
                                        "first_32_mean": round(1e3 * float(st[:32].mean()), 3),
                                        "last_32_mean": round(1e3 * float(st[-32:].mean()), 3)}}
        print(f"{variant}: {min(walls):.3f} s, {len(st)} steps, median step {results[variant]['step_ms']['median']} ms",
              flush=True)
    engine.step = step_fn
    # The profiled passes after every timed one: session 15's first version timed variants after a
    # torch.profiler pass, and those ran 25-35% slower (the profiler's hooks outlive its context).
    for variant in ([] if args.no_profile else [v for v in ("audit", "ded") if v in reqs_of]):
        reqs = reqs_of[variant]
        prof = profile_call(lambda: eng.generate(reqs), device, f"generate-{variant}")
        results[variant]["torch_profile"] = prof
        print(f"{variant} under torch.profiler: wall {prof['wall_s']} s, GPU busy {prof['busy_s']} s "
              f"({prof['busy_s'] / min(results[variant]['wall_s']):.2f} of the unprofiled wall), "
              f"kernels {prof['kernels']}", flush=True)
        pr = cProfile.Profile()
        t = time.perf_counter()
        pr.enable()
        eng.generate(reqs)
        pr.disable()
        wall = time.perf_counter() - t
        ps = pstats.Stats(pr, stream=io.StringIO())
        rows = []
        for (file, line, fn), (cc, nc, tt, ct, _) in ps.stats.items():
            rows.append({"fn": f"{Path(file).parent.name}/{Path(file).name}:{line}({fn})", "calls": nc,
                         "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)})
        results[variant]["cprofile"] = {"wall_s": round(wall, 4),
                                        "by_tottime": sorted(rows, key=lambda r: -r["tottime_s"])[:40],
                                        "by_cumtime": sorted(rows, key=lambda r: -r["cumtime_s"])[:60]}
        print(f"  cProfile wall {wall:.3f} s; top by own time:", flush=True)
        for r in results[variant]["cprofile"]["by_tottime"][:15]:
            print(f"    {r['tottime_s']:8.4f} s {r['calls']:8d}  {r['fn']}", flush=True)
    env = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "args": {k: str(v) for k, v in vars(args).items()},
           "engine_start_s": round(start_s, 1), "cuda_graphs": eng.cuda_graphs(),
           "lora_kernel_configs": eng.lora_kernel_configs, "host_cpus": os.cpu_count()}
    try:
        import vllm

        env["vllm"] = vllm.__version__
    except ImportError:
        pass
    Path(args.out).write_text(json.dumps({"env": env, "results": results}, indent=1))
    eng.close()


if __name__ == "__main__":
    main()
