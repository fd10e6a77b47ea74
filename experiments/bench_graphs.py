"""The trainer's step eager against CUDA-graphed (``real.graphed``), on a recorded run's rows.

For each case (a recorded run's step, the jobs one train step of that arm holds), two trainers over
two copies of the same random base (Qwen3-0.6B shape, bf16, element-wise ops compiled as in a run)
train the same jobs from the same seeds on the same rows: step time (after one untimed step that
compiles and captures), peak memory, and how far the graphed updates land from the eager ones,
next to the bf16 floor (eager against eager with other micro-batches).

    python experiments/bench_graphs.py --lengths-from RUN_DIR --out OUT.json
    python experiments/bench_graphs.py --tiny --out /tmp/graphs_tiny.json     # CPU: 'static' mode
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_trainer import (QWEN3_06B, TINY, add_recorded_bench_args, batch_tokens,  # noqa: E402
                                       env_header, recorded_batch, recorded_lengths)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_recorded_bench_args(p, jobs="1,4,8", iters=4)
    p.add_argument("--no-compile", action="store_true", help="leave the element-wise ops eager")
    p.add_argument("--no-floor", action="store_true", help="skip the eager-against-eager bf16 floor (a third trainer)")
    p.add_argument("--profile", action="store_true",
                   help="also put one step of the eager trainer, one graphed step and one of the "
                        "fixed-shape program run without capture (the graphed step's kernels, launched "
                        "one by one) under torch.profiler: where the GPU time goes")
    return p.parse_args(argv)


def rows_for(args, n_jobs: int, vocab: int) -> dict:
    if args.lengths_from:
        rec = recorded_lengths(args.lengths_from, args.step)
        jobs = sorted(rec, key=lambda j: int("".join(c for c in j if c.isdigit()) or 0))
        # More jobs than recorded: reuse the recorded jobs' rows in turn (other random tokens).
        return {f"job{k}": recorded_batch(*rec[jobs[k % len(jobs)]], vocab, seed=args.seed + k) for k in range(n_jobs)}
    import numpy as np

    rng = np.random.default_rng(args.seed)
    prompt, room = (8, 24) if args.tiny else (140, 256)
    return {f"job{k}": recorded_batch(prompt, [int(x) for x in np.clip(rng.lognormal(np.log(room / 2.5), 0.8, 16 if args.tiny else 64), 1, room)],
                                      vocab, seed=args.seed + k) for k in range(n_jobs)}


def make_trainer(args, mode: str, device, dtype, mb_tokens: int):
    import torch
    import transformers

    from real.fuse import fuse_elementwise
    from real.trainer import MultiLoRATrainer

    torch.manual_seed(args.seed)
    config = transformers.Qwen3Config(**(TINY if args.tiny else QWEN3_06B))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    if not args.tiny and not args.no_compile:
        fuse_elementwise(model)
    return MultiLoRATrainer(model, max_tokens_per_microbatch=mb_tokens, step_mode=mode)


def params(trainer):
    import torch

    return {j: torch.cat([p.detach().float().flatten() for p in trainer.adapter(j).parameters()])
            for j in trainer.jobs}


def rel(a, b) -> float:
    return max(float((a[j] - b[j]).norm() / b[j].norm().clamp_min(1e-30)) for j in b)


def run_case(args, n_jobs: int, device, dtype, floor: bool, partial=None) -> dict:
    import torch

    graphed = "static" if device.type == "cpu" else "graphed"
    modes = {"eager": args.mb_tokens, graphed: args.mb_tokens}
    if floor:
        modes["eager-floor"] = args.mb_tokens - 1024
    out = {"jobs": n_jobs}
    finals, init = {}, None
    batches = None
    for name, mb in modes.items():
        t = make_trainer(args, name.split("-")[0], device, dtype, mb)
        batches = batches or rows_for(args, n_jobs, t.vocab_size)
        for k in range(n_jobs):
            t.add_job(f"job{k}", rank=args.rank, alpha=2 * args.rank, lr=1e-4, seed=100 + k)
        init = init or params(t)
        times = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(1 + args.iters):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            t.train_step(batches)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        finals[name] = params(t)
        tokens, completion = batch_tokens(batches)
        out[name] = {"first_step_s": round(times[0], 4), "step_s": [round(x, 4) for x in times[1:]],
                     "median_s": round(sorted(times[1:])[len(times[1:]) // 2], 4), "tokens": tokens,
                     "completion_tokens": completion, "microbatches": t.last_microbatches,
                     "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
                     "graph_error": t.graph_error, "programs": [str(k) for k in t.programs]}
        print(f"[{n_jobs} jobs] {name}: {out[name]}", flush=True)
        if args.profile and name in ("eager", graphed):
            from real.profiling import profile_call

            # After the updates were taken: the profiled step trains once more.
            out[f"profile_{name}"] = profile_call(functools.partial(t.train_step, batches), device, f"{n_jobs} jobs {name}")
            if name == "graphed":  # the same program, its kernels launched one by one
                t.step_mode = "static"
                t._static.clear()
                out["profile_static"] = profile_call(functools.partial(t.train_step, batches), device,
                                                     f"{n_jobs} jobs static")
        if partial is not None:
            partial(out)  # what is measured so far reaches the file (a cut-off call still returns it)
        del t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    moved = rel(finals["eager"], init)
    out["update_rel_diff"] = {"graphed_vs_eager": rel_update(finals[graphed], finals["eager"], init),
                              "floor_eager_vs_eager": (rel_update(finals["eager-floor"], finals["eager"], init)
                                                       if floor else None),
                              "params_moved": moved}
    out["speedup"] = round(out["eager"]["median_s"] / out[graphed]["median_s"], 3)
    return out


def rel_update(got, want, init) -> float:
    """max over jobs of ||(got - init) - (want - init)|| / ||want - init||: the updates' disagreement."""
    return max(float(((got[j] - init[j]) - (want[j] - init[j])).norm() / (want[j] - init[j]).norm().clamp_min(1e-30))
               for j in want)


def main() -> None:
    args = parse_args()
    import torch

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    result = {"env": env_header(args, device), "cases": []}
    for i, n in enumerate(int(x) for x in args.jobs.split(",") if x):
        # The bf16 floor (eager against eager with other micro-batches) once: it costs a trainer.
        def partial(case):
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(dict(result, cases=result["cases"] + [case]), indent=1))

        result["cases"].append(run_case(args, n, device, dtype, floor=i == 0 and not args.no_floor, partial=partial))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps([{k: c[k] for k in ("jobs", "speedup", "update_rel_diff")} for c in result["cases"]], indent=1))


if __name__ == "__main__":
    main()
