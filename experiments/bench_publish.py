"""Where a publish's time goes: K jobs' new adapter versions loaded into one engine, the way an
overlap group's publish does it (`MultiLoRAEngine.publish`, one job after another), then one token
generated for all K jobs (their first step on the new versions copies them into the GPU slots).

Variants, taking turns version by version: vLLM's pinned host copies (its default on a GPU) against
pageable ones (`publish(pinned=False)`). With `--beside`, the same again while a second process
keeps the GPU busy with matmuls as an MPS client at below-normal priority: what a publish meets when
the trainer takes the next group's train at once (overlap `:free`). cProfile's heaviest functions
of the pinned publishes alone go in the report too.

    python experiments/bench_publish.py --model DIR --jobs 4 --versions 10 [--beside] --out publish.json

The adapters are random rank-r PEFT folders of the model's shape (experiments/bench_hotload.py); a
check compares the greedy first tokens of four prompts after a pinned and an unpinned load of the
same folder.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOAD = """
import os, sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
open(sys.argv[1] + ".up", "w").close()
while not os.path.exists(sys.argv[1]):
    for _ in range(8):
        a @ a
    torch.cuda.synchronize()
"""


PROFILED = 3  # versions published under cProfile
FOLDERS = 4


def progress(what: str) -> None:
    """One line a part, as it begins: a call cut short shows how far it got."""
    print(f"[bench_publish {time.strftime('%H:%M:%S')}] {what}", flush=True)


def summary(xs: list[float]) -> dict:
    from experiments.bench_hotload import quartiles

    return {"mean": statistics.fmean(xs), **quartiles(xs)}


def write(report: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def one_version(engine, jobs: list[str], v: int, folders: dict, pinned: bool, profiler=None) -> dict:
    """Publish version v of every job, then one token for all of them; the seconds of each part."""
    from real.engine import GenRequest

    t = time.monotonic()
    if profiler is not None:
        profiler.enable()
    each = [engine.publish(j, v, folders[j][v], pinned=pinned) for j in jobs]
    if profiler is not None:
        profiler.disable()
    publish_s = time.monotonic() - t
    t = time.monotonic()
    engine.generate([GenRequest(j, v, [[5, 6, 7, 8]], n=1, max_new_tokens=1, temperature=0.0) for j in jobs])
    return {"publish_s": publish_s, "per_adapter_s": each, "first_token_s": time.monotonic() - t}


def block(engine, jobs, folders, versions: range) -> dict:
    rows = {"pinned": [], "unpinned": []}
    for v in versions:  # each variant its own version (a publish needs a newer one): v and v + 1
        for k, name in enumerate(rows):
            rows[name].append(one_version(engine, jobs, v + k, folders, name == "pinned"))
    return {name: {"publish_s": summary([r["publish_s"] for r in rs]),
                   "per_adapter_s": summary([x for r in rs for x in r["per_adapter_s"]]),
                   "first_token_s": summary([r["first_token_s"] for r in rs])} for name, rs in rows.items()}


def profiled(engine, jobs, folders, versions: range) -> str:
    """cProfile's heaviest functions (own time) of pinned publishes (untimed: the profiler's own
    cost would tilt the comparison)."""
    prof = cProfile.Profile()
    for v in versions:
        one_version(engine, jobs, v, folders, True, prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a local model folder (config.json + weights)")
    p.add_argument("--jobs", type=int, default=4, help="adapters published together (an overlap group's jobs)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--versions", type=int, default=10, help="versions published per variant and block")
    p.add_argument("--beside", action="store_true", help="also beside a GPU load under MPS (needs a GPU)")
    p.add_argument("--out", required=True)
    p.add_argument("--dump-stacks-after", type=float, default=None, metavar="S",
                   help="print every thread's stack of this process after S seconds (set it under the call's "
                        "time limit: a part that hangs here then says where; not the GPU load's process)")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.versions < 2:
        p.error("--jobs >= 1 and --versions >= 2")
    if args.dump_stacks_after is not None:
        if args.dump_stacks_after <= 0:
            p.error("--dump-stacks-after must be > 0 seconds")
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_stacks_after, exit=False)

    mps = None
    if args.beside:
        from real.mps import MPSDaemon

        mps = MPSDaemon().start()
        os.environ.update(mps.env)  # this process (the engine) is an MPS client too
    from experiments.bench_hotload import write_random_adapter
    from real.engine import GenRequest, MultiLoRAEngine

    work = Path(tempfile.mkdtemp(prefix="nodus-publish-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    jobs = [f"job{i}" for i in range(args.jobs)]
    n_versions = 1 + 2 * args.versions * (2 if args.beside else 1) + PROFILED
    base = Path(args.model)
    # Four folders a job, in turn (a version is a new adapter to the engine whatever its folder),
    # in bf16 as the trainer saves them on a GPU.
    import torch

    dtype = torch.bfloat16 if torch.cuda.is_available() else None
    own = {j: [write_random_adapter(base, work / j / f"f{k}", args.rank, seed=1000 * i + k, dtype=dtype)
               for k in range(FOLDERS)] for i, j in enumerate(jobs)}
    folders = {j: [own[j][v % FOLDERS] for v in range(n_versions)] for j in jobs}
    load = None
    try:
        t0 = time.monotonic()
        engine = MultiLoRAEngine(base, max_loras=args.jobs, max_cpu_loras=args.jobs + 1, max_lora_rank=args.rank,
                                 max_num_seqs=64,
                                 max_model_len=512, gpu_memory_utilization=0.3, enforce_eager=True,
                                 skip_tokenizer_init=True)
        start_s = time.monotonic() - t0
        for j in jobs:
            engine.publish(j, 0, folders[j][0])
        engine.generate([GenRequest(j, 0, [[5, 6, 7, 8]], n=1, max_new_tokens=1, temperature=0.0) for j in jobs])
        progress("alone: publishing")
        alone = block(engine, jobs, folders, range(1, 1 + 2 * args.versions, 2))
        v = 1 + 2 * args.versions
        profile = profiled(engine, jobs, folders, range(v, v + PROFILED))
        v += PROFILED
        report = {"model": str(base), "jobs": args.jobs, "rank": args.rank, "engine_start_s": start_s,
                  "adapter_bytes": (folders[jobs[0]][0] / "adapter_model.safetensors").stat().st_size,
                  "alone": alone, "profile_pinned_alone": profile}
        write(report, args.out)  # a call cut short still returns what it measured
        print(profile, flush=True)
        # The same folder loaded pinned and unpinned gives the same greedy first tokens, on steps of
        # the shape the blocks ran (4 prompts of 4 tokens: no kernel left to compile); before the
        # GPU load, whose part a call is likelier to run out of time in.
        progress("check: pinned against unpinned")
        last = n_versions - 1
        prompts = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]]
        got = {}
        for k, pinned in enumerate((True, False)):
            engine.publish("check", k, folders[jobs[0]][last], pinned=pinned)
            batch = engine.generate([GenRequest("check", k, prompts, n=1, max_new_tokens=1, temperature=0.0)])[0]
            got[pinned] = [c[0] for c in batch.completion_token_ids]
        report["same_tokens_pinned_unpinned"] = got[True] == got[False]
        write(report, args.out)
        if args.beside:
            progress("beside: starting the GPU load")
            stop = str(work / "stop")
            env = dict(os.environ, CUDA_MPS_CLIENT_PRIORITY="1")
            load = subprocess.Popen([sys.executable, "-c", LOAD, stop], env=env)
            deadline = time.monotonic() + 120
            while not os.path.exists(stop + ".up"):
                if load.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the GPU load process did not start")
                time.sleep(0.2)
            progress("beside: publishing")
            report["beside"] = block(engine, jobs, folders, range(v, n_versions, 2))
            write(report, args.out)
            progress("beside: stopping the GPU load")
            Path(stop).touch()
            load.wait(timeout=60)
        progress("closing the engine")
        engine.close()
    finally:
        if load is not None and load.poll() is None:
            load.kill()
        if mps is not None:
            mps.stop()
        if args.dump_stacks_after is not None:
            import faulthandler

            faulthandler.cancel_dump_traceback_later()  # done: a caller in this process gets no late dump
    write(report, args.out)
    for part in ("alone", "beside"):
        for name, r in report.get(part, {}).items():
            print(f"{part:6s} {name:8s} publish of {args.jobs}: {r['publish_s']['median'] * 1e3:7.1f} ms median "
                  f"({r['per_adapter_s']['median'] * 1e3:.1f} ms an adapter), first token "
                  f"{r['first_token_s']['median'] * 1e3:.1f} ms")
    print("same tokens pinned/unpinned:", report["same_tokens_pinned_unpinned"])
    return report


if __name__ == "__main__":
    main()
