"""Both sides of a step's adapter handoff, PEFT safetensors folders against the flat file
(real/flat_adapter.py, `RealOptions.adapter_format`): the trainer's save of K jobs' new versions
(what `save_adapter` adds to each train step) and the engine's publish of them, then one token for
all K jobs (their first step on the new versions copies them into the GPU slots).

    python experiments/bench_handoff.py --model DIR --jobs 4 --versions 10 --out handoff.json

The adapters have the model's shape (rank --rank, every attention and MLP projection) and live on
the trainer's device (a GPU where there is one), in the dtype the trainer saves; each version
nudges every B, so each save copies new numbers. The formats take turns version by version. A
check compares the greedy first tokens of four prompts after the same version was published in
each format; cProfile's heaviest functions (own time) of 3 more publishes in each format go in the
report too (untimed: the profiler's cost would tilt the comparison), to say what each leaves.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMATS = ("safetensors", "flat")
PROFILED = 3  # versions per format published under cProfile
LOADERS = "from_lora_tensors|safe_open"  # the functions that read each format's adapter in the engine
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]]


def progress(what: str) -> None:
    print(f"[bench_handoff {time.strftime('%H:%M:%S')}] {what}", flush=True)


def make_adapters(config: dict, jobs: list[str], rank: int, device: str, dtype) -> dict:
    """One Adapter a job, A as PEFT initialises it, B random (a trained adapter's, not zeros)."""
    import torch

    from experiments.bench_hotload import lora_shapes
    from real.multilora import init_adapter

    shapes = {}
    for layer in range(config["num_hidden_layers"]):
        for name, io in lora_shapes(config).items():
            part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            shapes[f"model.layers.{layer}.{part}.{name}"] = io
    out = {}
    for i, job in enumerate(jobs):
        g = torch.Generator().manual_seed(1000 + i)
        adapter = init_adapter(shapes, rank, 2 * rank, g, device, dtype)
        with torch.no_grad():
            for b in adapter.B.values():
                b.normal_(std=0.05)
        out[job] = adapter
    return out


def nudge(adapters: dict) -> None:
    """A train step's update: new numbers in every B (its kernels finished before a save's clock)."""
    import torch

    with torch.no_grad():
        for adapter in adapters.values():
            for b in adapter.B.values():
                b.mul_(0.999)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def save_version(adapters: dict, root: Path, v: int, fmt: str, dtype, targets) -> tuple[dict, float, list[float]]:
    """Each job's version v saved in ``fmt``: its folders, the seconds of all K saves, and each's."""
    from real.multilora import save_flat_adapter, save_peft_adapter

    save = save_flat_adapter if fmt == "flat" else save_peft_adapter
    folders, each = {}, []
    t = time.perf_counter()
    for job, adapter in adapters.items():
        t1 = time.perf_counter()
        folders[job] = root / fmt / job / f"v{v}"
        save(adapter, folders[job], targets, None, dtype)
        each.append(time.perf_counter() - t1)
    return folders, time.perf_counter() - t, each


def publish_version(engine, folders: dict, v: int) -> tuple[float, list[float], float]:
    """Publish every job's version v (one after another, as a step's publish does), then one token
    for all of them: the publish's seconds, each adapter's, and the token's."""
    from real.engine import GenRequest

    t = time.perf_counter()
    each = [engine.publish(job, v, folder) for job, folder in folders.items()]
    publish_s = time.perf_counter() - t
    t = time.perf_counter()
    engine.generate([GenRequest(job, v, [PROMPTS[0]], n=1, max_new_tokens=1, temperature=0.0) for job in folders])
    return publish_s, each, time.perf_counter() - t


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, type=Path, help="a local model folder (config.json + weights)")
    p.add_argument("--jobs", type=int, default=4, help="adapters saved and published together (a group's jobs)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--versions", type=int, default=10, help="versions saved and published per format")
    p.add_argument("--dtype", default=None, help="the saved adapters' and the engine's dtype "
                                                 "(default: bfloat16 on a GPU, float32 on a CPU)")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    if args.jobs < 1 or args.versions < 2:
        p.error("--jobs >= 1 and --versions >= 2")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there")
    import torch

    from experiments.bench_hotload import env_header
    from real.engine import GenRequest, MultiLoRAEngine
    from real.multilora import DEFAULT_TARGET_MODULES

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_name = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    if dtype_name not in ("float32", "bfloat16", "float16"):
        p.error(f"--dtype {dtype_name}: float32, bfloat16 or float16")
    dtype = getattr(torch, dtype_name)
    config = json.loads((args.model / "config.json").read_text())
    jobs = [f"job{i}" for i in range(args.jobs)]
    adapters = make_adapters(config, jobs, args.rank, device, dtype)
    work = Path(tempfile.mkdtemp(prefix="nodus-handoff-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    report = {"env": env_header(args), "model": str(args.model), "jobs": args.jobs, "rank": args.rank,
              "trainer_device": device, "dtype": dtype_name}
    engine = None
    try:
        progress("starting the engine")
        t0 = time.monotonic()
        engine = MultiLoRAEngine(args.model, max_loras=args.jobs, max_cpu_loras=args.jobs + 1, max_lora_rank=args.rank,
                                 max_num_seqs=64, max_model_len=512, gpu_memory_utilization=0.3, enforce_eager=True,
                                 skip_tokenizer_init=True, dtype=dtype_name)
        report["engine_start_s"] = time.monotonic() - t0
        rows = {fmt: {"save_s": [], "save_each_s": [], "publish_s": [], "publish_each_s": [], "first_token_s": []}
                for fmt in FORMATS}
        # Version 0 in each format untimed (first loads), then the formats in turn.
        v = 0
        for k in range(args.versions + 1):
            nudge(adapters)  # both formats save the same numbers
            for fmt in FORMATS:
                folders, save_s, save_each = save_version(adapters, work, v, fmt, dtype, DEFAULT_TARGET_MODULES)
                publish_s, publish_each, token_s = publish_version(engine, folders, v)
                report.setdefault("adapter_bytes", {})[fmt] = sum(  # one adapter's folder
                    f.stat().st_size for f in folders[jobs[0]].iterdir())
                if k:
                    for key, x in (("save_s", [save_s]), ("save_each_s", save_each), ("publish_s", [publish_s]),
                                   ("publish_each_s", publish_each), ("first_token_s", [token_s])):
                        rows[fmt][key] += x
                for folder in folders.values():  # the engine holds its own copy (and /dev/shm is memory)
                    shutil.rmtree(folder)
                v += 1
            progress(f"version {k} of {args.versions}: " + ", ".join(
                f"{fmt} save {rows[fmt]['save_s'][-1]:.3f} s publish {rows[fmt]['publish_s'][-1]:.3f} s"
                for fmt in FORMATS if rows[fmt]["save_s"]))
        from experiments.bench_publish import summary  # mean and quartiles

        report["formats"] = {fmt: {key: summary(xs) for key, xs in r.items()} for fmt, r in rows.items()}
        base, flat = (report["formats"][f] for f in FORMATS)
        report["flat_saves"] = {key: base[key]["median"] - flat[key]["median"]
                                for key in ("save_s", "publish_s", "first_token_s")}
        report["profiles"] = {}
        for fmt in FORMATS:
            prof = cProfile.Profile()
            for _ in range(PROFILED):
                nudge(adapters)
                folders, _, _ = save_version(adapters, work, v, fmt, dtype, DEFAULT_TARGET_MODULES)
                prof.enable()
                for job, folder in folders.items():
                    engine.publish(job, v, folder)
                prof.disable()
                engine.generate([GenRequest(job, v, [PROMPTS[0]], n=1, max_new_tokens=1, temperature=0.0)
                                 for job in folders])
                for folder in folders.values():
                    shutil.rmtree(folder)
                v += 1
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            stats.sort_stats("tottime").print_stats(20)
            # Each format's own loader, whatever its share: under load it can fall out of the top 20
            # (a fresh clone beside other work on two cores: the flat loader did).
            buf.write("\nThe loaders:\n")
            stats.sort_stats("cumulative").print_stats(LOADERS)
            report["profiles"][fmt] = buf.getvalue()
        # The same numbers in each format: the same greedy first tokens.
        got = {}
        for fmt in FORMATS:
            folders, _, _ = save_version({jobs[0]: adapters[jobs[0]]}, work, v, fmt, dtype, DEFAULT_TARGET_MODULES)
            engine.publish(f"check-{fmt}", 0, folders[jobs[0]])
            batch = engine.generate([GenRequest(f"check-{fmt}", 0, PROMPTS, n=1, max_new_tokens=1, temperature=0.0)])[0]
            got[fmt] = [c[0] for c in batch.completion_token_ids]
        report["same_tokens"] = got["flat"] == got["safetensors"]
        report["check_tokens"] = got
    finally:
        if engine is not None:
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    progress(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
