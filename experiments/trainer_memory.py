"""Measure a trainer's GPU memory at each micro-batch size: what the fit check estimates.

Each size runs in a process of its own on an otherwise idle GPU: a Qwen3-0.6B-shaped base with
random weights (no hub), the trainer the real backend starts (``real.trainer.MultiLoRATrainer``),
and its warm-up exactly as a run's (``real.workers.warm_trainer``: every program of the run's steps
built and, graphed, captured; one scratch train step), then one more scratch step. Written per
size: the allocator's peaks (``real.workers.trainer_memory``), the device's memory in use (the
process's CUDA context included), whether the capture held, and the fit check's estimate
(``nodus.gpumemory.trainer_gib_estimate``) beside them. No vLLM, no pydantic: it runs on the lent GPU
without the bundle.

    python experiments/trainer_memory.py --out trainer_memory.json                  # GPU, graphed
    python experiments/trainer_memory.py --tiny --device cpu --mode static --mb-tokens 512,1024 --out /tmp/tm.json

The default shape is the reference workload's on one of two stacks: 4 jobs a train step, 64 rows
each (8 prompts x 8 responses), 140 prompt and 256 new tokens, 4 responses a packed row, rank 16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as bench_trainer
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=128, vocab_size=256, tie_word_embeddings=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb-tokens", default="4096,8192,16384", help="micro-batch sizes, comma-separated")
    p.add_argument("--mode", default="graphed", choices=("graphed", "static", "eager"), help="the trainer's step mode")
    p.add_argument("--jobs", type=int, default=4, help="jobs in one train step (the stack's)")
    p.add_argument("--rows", type=int, default=64, help="rows a job trains a step")
    p.add_argument("--prompt-tokens", type=int, default=140)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--share-prompts", type=int, default=4, help="responses a packed row holds (0 or 1: none)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (a CPU smoke test)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds each size may take")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child: one size
    args = p.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.mb_tokens.split(",") if x]
    except ValueError:
        p.error(f"--mb-tokens {args.mb_tokens!r}: give sizes as integers, comma-separated")
    if not args.sizes or min(args.sizes) < 256:
        p.error(f"--mb-tokens {args.mb_tokens!r}: each size at least 256 tokens")
    for name in ("jobs", "rows", "prompt_tokens", "new_tokens", "rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    return args


def estimate_gib(mb: int, graphed: bool) -> float | None:
    """The fit check's estimate for this size (nodus.gpumemory: pure Python, so on a bare GPU host too)."""
    from nodus.gpumemory import trainer_gib_estimate

    return trainer_gib_estimate(mb, graphed=graphed)


def measure_one(args, mb: int) -> dict:
    """One size, in this process: build, warm up as a run does, one more step; the memory after."""
    import torch
    import transformers

    from real.trainer import MultiLoRATrainer
    from real.workers import trainer_memory, warm_trainer

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.Qwen3Config(**(TINY if args.tiny else QWEN3_06B)), attn_implementation="sdpa", dtype=dtype)
    trainer = MultiLoRATrainer(model, device=dev, max_tokens_per_microbatch=mb, step_mode=args.mode)
    seq = args.prompt_tokens + args.new_tokens
    packed = args.prompt_tokens + max(args.share_prompts, 1) * args.new_tokens
    fixed = args.mode != "eager"
    t0 = time.monotonic()
    warm_trainer(trainer, args.rank, args.rows, seq, args.jobs if fixed else None,
                 args.share_prompts if fixed else None, packed if fixed else None)
    warm_s = time.monotonic() - t0
    warm_trainer(trainer, args.rank, args.rows, seq, args.jobs if fixed else None,
                 args.share_prompts if fixed else None, packed if fixed else None)
    row = {"mb_tokens": mb, "mode": args.mode, "step_mode": trainer.step_mode, "graph_error": trainer.graph_error,
           "graphs": len(trainer.programs), "warm_s": round(warm_s, 2),
           "memory": trainer_memory(dev, mb),
           "estimate_gib": estimate_gib(mb, args.mode == "graphed")}
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        free, total = torch.cuda.mem_get_info(dev)
        row["device_used_gib"] = round((total - free) / 2 ** 30, 2)  # this process's context included
        row["device_total_gib"] = round(total / 2 ** 30, 2)
        row["gpu"] = torch.cuda.get_device_name(dev)
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one is not None:
        print("ROW " + json.dumps(measure_one(args, args.one)), flush=True)
        return
    rows = []
    base = [a for a in (argv if argv is not None else sys.argv[1:])]
    for mb in args.sizes:
        cmd = [sys.executable, str(Path(__file__).resolve()), *base, "--one", str(mb)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            rows.append({"mb_tokens": mb, "error": f"timed out after {args.timeout:.0f} s"})
            print(f"mb {mb}: timed out", flush=True)
            continue
        found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if done.returncode != 0 or not found:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            rows.append({"mb_tokens": mb, "error": " | ".join(tail)})
            print(f"mb {mb}: failed: {' | '.join(tail)}", flush=True)
            continue
        row = json.loads(found[-1])
        rows.append(row)
        m = row["memory"] or {}
        print(f"mb {mb}: {row['step_mode']}, peak reserved {m.get('peak_reserved_gib')} GiB, device used "
              f"{row.get('device_used_gib')} GiB, estimate {row['estimate_gib']} GiB"
              + (f", capture failed: {row['graph_error']}" if row["graph_error"] else ""), flush=True)
    out = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "one")},
           "commit": os.environ.get("NODUS_COMMIT"), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
