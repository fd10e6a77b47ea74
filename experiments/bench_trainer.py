"""Benchmark the multi-LoRA trainer: tokens/s of one GRPO step (forward + backward + clip + AdamW)
with many adapters in one shared batch, against one adapter and against a per-job loop.

Measured (each a section of the JSON written to --out, with an environment header):
  multi        J jobs x S sequences x L tokens in one train_step, for each --mb-tokens
  one_adapter  the same tokens as one job (the multi-adapter overhead is the difference)
  per_job_loop J train_steps of one job each (what batching the jobs saves)
  peft         one PEFT LoRA adapter, full logits, same loss/clip/AdamW, the usual way (--peft)
  equivalence  bf16 max relative difference, batched vs solo updates, for 3 jobs over 2 steps,
               next to the same measure between two batchings (the bf16 rounding floor)
  save         save_adapter (PEFT format) time per job into /dev/shm
  fused        multi again with RMSNorm, rotary and SiLU*up compiled by torch.compile (--no-fused: skip)

The base is a Qwen3-0.6B-shaped model with random weights built from a Qwen3Config (no hub).

    python experiments/bench_trainer.py                    # GPU, bf16, Qwen3-0.6B shapes
    python experiments/bench_trainer.py --tiny --out /tmp/bench_tiny.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Micro-batches vary in shape; expandable segments keep the caching allocator from fragmenting.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=128, vocab_size=256, tie_word_embeddings=True)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="experiments/results/bench_trainer_h200.json")
    p.add_argument("--tiny", action="store_true", help="tiny model and batch on CPU (smoke test)")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--seqs-per-job", type=int, default=64)
    p.add_argument("--seq-tokens", type=int, default=320, help="prompt + completion tokens per sequence")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--length-spread", type=float, default=0.0,
                   help="0: every sequence is --seq-tokens long; f: lengths uniform in [(1-f)L, L]")
    p.add_argument("--lengths", choices=("uniform", "longtail"), default="uniform",
                   help="longtail: response lengths lognormal (median 100, sigma 0.8, <= seq-tokens minus "
                        "prompt), like the reference workload's; uniform: see --length-spread")
    p.add_argument("--lengths-from", default=None, metavar="RUN_DIR",
                   help="the rows of a recorded real run instead of synthetic ones: each job's prompt and "
                        "response lengths of one step (its spans.jsonl generate spans); --jobs and "
                        "--seqs-per-job then come from the run")
    p.add_argument("--lengths-step", type=int, default=1, help="which step of --lengths-from (0-based)")
    p.add_argument("--layouts", default="auto",
                   help="comma list of trainer LoRA layouts to measure multi with (auto, masked, padded)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--mb-tokens", type=int, nargs="+", default=[16384, 32768],
                   help="max padded tokens per micro-batch; one multi measurement per value")
    p.add_argument("--chunk-tokens", type=int, default=4096, help="tokens per lm_head/log-softmax chunk")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--no-loop", action="store_true", help="skip the per-job loop baseline")
    p.add_argument("--peft", action=argparse.BooleanOptionalAction, default=True,
                   help="measure a one-adapter PEFT baseline")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure with RMSNorm, rotary and SiLU*up compiled (torch.compile)")
    p.add_argument("--fused-mb-tokens", type=int, default=None, help="micro-batch for --fused (default: largest)")
    p.add_argument("--fused-layout", default="masked", choices=("padded", "masked", "auto"),
                   help="multi-adapter layout for --fused")
    p.add_argument("--peft-mb-seqs", type=int, default=16, help="PEFT baseline sequences per micro-batch")
    p.add_argument("--save-dir", default="/dev/shm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over one multi step per layout: where the time goes (top kernels, "
                        "the trainer's phases, GPU-busy fraction)")
    args = p.parse_args(argv)
    if args.tiny:
        args.seqs_per_job, args.seq_tokens, args.prompt_tokens = 4, 32, 8
        args.mb_tokens = [64, 256]
        args.chunk_tokens = 64
        args.iters, args.warmup = 2, 1
        args.rank = min(args.rank, 8)
    return args


def env_header(args, device) -> dict:
    import peft
    import torch
    import transformers

    cuda = device.type == "cuda"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1) if cuda else None,
        "cuda": torch.version.cuda, "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "python": platform.python_version(), "host": platform.node(),
        "cpu_count": os.cpu_count(), "args": vars(args),
    }


def build_base(args, device, dtype):
    import torch
    import transformers

    torch.manual_seed(args.seed)
    config = transformers.Qwen3Config(**(TINY if args.tiny else QWEN3_06B))
    with torch.device(device):  # initialise on the device: random init of 0.6B params on CPU is slow
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model


def make_batch(args, n_seqs, vocab, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    if args.lengths == "longtail":
        room = args.seq_tokens - args.prompt_tokens
        resp = np.clip(np.round(rng.lognormal(np.log(min(100, room)), 0.8, n_seqs)), 1, room).astype(int)
    else:
        lo = max(args.prompt_tokens + 1, int(round(args.seq_tokens * (1 - args.length_spread))))
        resp = rng.integers(lo, args.seq_tokens + 1, n_seqs) - args.prompt_tokens
    return _random_rows(rng, args.prompt_tokens, [int(r) for r in resp], vocab)


def add_recorded_bench_args(p: argparse.ArgumentParser, jobs: str, iters: int) -> None:
    """The arguments of a trainer bench over cases of N jobs in a recorded run's rows
    (bench_graphs.py, bench_shared_prompts.py): --out, --lengths-from, --step, --jobs, --mb-tokens,
    --iters, --rank, --tiny, --seed."""
    p.add_argument("--out", required=True)
    p.add_argument("--lengths-from", default=None, metavar="RUN_DIR",
                   help="a run folder whose step's prompt and response lengths the rows take (default: synthetic)")
    p.add_argument("--step", type=int, default=1)
    p.add_argument("--jobs", default=jobs, help="comma list: jobs per train step of each case")
    p.add_argument("--mb-tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU, the uncaptured program")
    p.add_argument("--seed", type=int, default=0)


def recorded_lengths(run_dir: str, step: int) -> dict[str, tuple[int, list[int]]]:
    """job -> (prompt tokens per sequence, response lengths) of ``step`` in a recorded run."""
    from nodus.config import ConfigError
    from nodus.lengths import recorded_step_lengths

    try:
        return recorded_step_lengths(run_dir, step)
    except ConfigError as e:
        raise SystemExit(f"--lengths-from {e}") from None


def recorded_batch(prompt: int, responses: list[int], vocab: int, seed: int):
    import numpy as np

    return _random_rows(np.random.default_rng(seed), prompt, responses, vocab)


def _random_rows(rng, prompt: int, responses: list[int], vocab: int):
    """A JobBatch of random token ids: ``prompt`` prompt tokens and each response's length per
    row, the responses trained on, random advantages."""
    from real.trainer import JobBatch

    ids = [rng.integers(0, vocab, prompt + r).tolist() for r in responses]
    mask = [[0] * prompt + [1] * r for r in responses]
    return JobBatch(ids, mask, rng.normal(size=len(responses)).tolist())


def batch_tokens(batches) -> tuple[int, int]:
    total = sum(len(r) for b in batches.values() for r in b.input_ids)
    completion = sum(sum(m) for b in batches.values() for m in b.completion_mask)
    return total, completion


def timed(fn, device, warmup, iters) -> list[float]:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def peak_gib(device) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def throughput(name, times, tokens, completion, device, **extra) -> dict:
    best, mean = min(times), sum(times) / len(times)
    row = {"name": name, "step_s": [round(t, 4) for t in times], "tokens": tokens,
           "completion_tokens": completion, "tokens_per_s_mean": round(tokens / mean),
           "tokens_per_s_best": round(tokens / best), "peak_gib": peak_gib(device), **extra}
    log(f"{name}: {row['tokens_per_s_mean']:,} tok/s (best {row['tokens_per_s_best']:,}), "
        f"step {mean:.3f} s, peak {row['peak_gib']} GiB")
    return row


def bench_multi(args, trainer, batches, device) -> list[dict]:
    from real.trainer import plan_microbatches

    tokens, completion = batch_tokens(batches)
    rows = []
    for layout in [x for x in args.layouts.split(",") if x]:
        trainer.routing.layout_mode = layout
        for mb_tokens in args.mb_tokens:
            trainer.max_tokens_per_microbatch = mb_tokens
            plan = plan_microbatches([[len(r) for r in b.input_ids] for b in batches.values()], mb_tokens)
            padded = sum(len(mb) * max(len(batches[list(batches)[j]].input_ids[s]) for j, s in mb) for mb in plan)
            reset_peak(device)
            log(f"multi ({layout}): {len(batches)} adapters, {tokens:,} tokens, mb {mb_tokens}: "
                f"{len(plan)} micro-batches")
            times = timed(lambda: trainer.train_step(batches), device, args.warmup, args.iters)
            rows.append(throughput(f"multi_{len(batches)}x_mb{mb_tokens}_{layout}", times, tokens, completion,
                                   device, adapters=len(batches), mb_tokens=mb_tokens, microbatches=len(plan),
                                   padded_tokens=padded, layout=layout))
    return rows


def bench_one_adapter(args, trainer, batches, device) -> dict:
    from real.trainer import JobBatch

    merged = JobBatch([r for b in batches.values() for r in b.input_ids],
                      [m for b in batches.values() for m in b.completion_mask],
                      [a for b in batches.values() for a in b.advantages])
    trainer.add_job("one", rank=args.rank, alpha=2 * args.rank, lr=1e-5, seed=999)
    trainer.max_tokens_per_microbatch = max(args.mb_tokens)
    tokens, completion = batch_tokens({"one": merged})
    reset_peak(device)
    log(f"one_adapter: {tokens:,} tokens as one job")
    times = timed(lambda: trainer.train_step({"one": merged}), device, args.warmup, args.iters)
    trainer.remove_job("one")
    return throughput("one_adapter", times, tokens, completion, device, adapters=1,
                      mb_tokens=trainer.max_tokens_per_microbatch)


def bench_loop(args, trainer, batches, device) -> dict:
    trainer.max_tokens_per_microbatch = max(args.mb_tokens)
    tokens, completion = batch_tokens(batches)
    reset_peak(device)
    log(f"per_job_loop: {len(batches)} train_steps of one job each")

    def loop():
        for job_id, batch in batches.items():
            trainer.train_step({job_id: batch})

    times = timed(loop, device, args.warmup, args.iters)
    return throughput("per_job_loop", times, tokens, completion, device, adapters=len(batches),
                      mb_tokens=trainer.max_tokens_per_microbatch)


def bench_peft(args, batch, device, dtype) -> dict:
    """One PEFT adapter, the usual way: full logits, log_softmax, same GRPO loss, clip, AdamW."""
    import peft
    import torch

    from real.grpo_loss import aggregate_loss, per_token_loss

    model = peft.get_peft_model(build_base(args, device, dtype), peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.eval()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    n = len(batch.input_ids)
    width = max(len(r) for r in batch.input_ids)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width - 1, dtype=torch.bool)
    for i, (row, m) in enumerate(zip(batch.input_ids, batch.completion_mask)):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row) - 1] = torch.tensor(m[1:], dtype=torch.bool)
    ids, mask = ids.to(device), mask.to(device)
    adv = torch.tensor(batch.advantages, device=device)

    def step():
        for s in range(0, n, args.peft_mb_seqs):
            sl = slice(s, s + args.peft_mb_seqs)
            logits = model(input_ids=ids[sl]).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(2, ids[sl, 1:, None]).squeeze(2)
            loss = aggregate_loss(per_token_loss(logp, None, adv[sl]), mask[sl], "grpo", num_seqs=n)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    tokens, completion = batch_tokens({"peft": batch})
    reset_peak(device)
    resident = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    log(f"peft: one adapter, {tokens:,} tokens, {args.peft_mb_seqs} sequences per micro-batch")
    times = timed(step, device, args.warmup, args.iters)
    # peak_gib includes the trainer's model, still resident: resident_before_gib says how much.
    row = throughput("peft_one_adapter", times, tokens, completion, device, adapters=1,
                     mb_seqs=args.peft_mb_seqs, resident_before_gib=None if resident is None else round(resident, 2))
    del model, opt
    return row


def bench_equivalence(args, trainer, batches, device, dtype) -> dict:
    """Batched vs solo updates of 3 jobs over 2 steps, from identical states (checkpoints)."""
    import numpy as np
    import torch

    from real.trainer import JobBatch

    specs = {"eq0": dict(rank=max(2, args.rank // 2), lr=2e-4), "eq1": dict(rank=args.rank, lr=1e-4),
             "eq2": dict(rank=2 * args.rank, lr=5e-5)}
    for i, (job_id, spec) in enumerate(specs.items()):
        trainer.add_job(job_id, rank=spec["rank"], alpha=2 * spec["rank"], lr=spec["lr"], seed=100 + i,
                        max_grad_norm=1.0 if i else 0.1)
    sources = list(batches.values())
    steps = []
    for step in range(2):
        data = {}
        for i, job_id in enumerate(specs):
            b = sources[i % len(sources)]
            keep = max(1, len(b.input_ids) * (4 - i) // 4)  # different sequence counts per job
            rng = np.random.default_rng(1000 * step + i)
            data[job_id] = JobBatch(b.input_ids[:keep], b.completion_mask[:keep], rng.normal(size=keep).tolist())
        steps.append(data)
    start = {j: trainer.state_dict_job(j) for j in specs}

    def run(groups, mb_tokens):
        for j, state in start.items():
            trainer.load_state_job(j, state)
        trainer.max_tokens_per_microbatch = mb_tokens
        for data in steps:
            for group in groups:
                trainer.train_step({j: data[j] for j in group})
        out = {}
        for j in specs:
            a = trainer.adapter(j)
            out[j] = {f"{n}.{ab}": getattr(a, ab)[n].detach().float().clone() for n in a.A for ab in ("A", "B")}
        return out

    def compare(x, y, init):
        rows = {}
        for j in specs:
            keys = list(x[j])
            per_tensor = max(((x[j][k] - y[j][k]).abs().max() / y[j][k].abs().max().clamp_min(1e-30)).item()
                             for k in keys)
            vx, vy, v0 = (torch.cat([d[k].flatten() for k in keys]) for d in (x[j], y[j], init[j]))
            rows[j] = {"max_rel_diff_per_tensor": per_tensor,
                       "rel_diff_norm": ((vx - vy).norm() / vy.norm()).item(),
                       "rel_diff_of_update_norm": ((vx - vy).norm() / (vy - v0).norm().clamp_min(1e-30)).item()}
        return rows

    mb = max(args.mb_tokens)
    init = {j: {**{f"{n}.A": start[j]["A"][n].float().to(device) for n in start[j]["A"]},
                **{f"{n}.B": start[j]["B"][n].float().to(device) for n in start[j]["B"]}} for j in specs}
    log(f"equivalence: batched vs solo, {dtype}, 3 jobs x 2 steps")
    batched = run([list(specs)], mb)
    solo = run([[j] for j in specs], mb)
    rebatched = run([list(specs)], max(mb // 4, 64))
    for j in specs:
        trainer.remove_job(j)
    result = {"dtype": str(dtype), "mb_tokens": mb, "rebatched_mb_tokens": max(mb // 4, 64),
              "jobs": {j: {**specs[j], "sequences": [len(s[j].input_ids) for s in steps]} for j in specs},
              "batched_vs_solo": compare(batched, solo, init),
              "batched_vs_rebatched_floor": compare(batched, rebatched, init)}
    for j in specs:
        log(f"  {j}: batched vs solo {result['batched_vs_solo'][j]}")
        log(f"  {j}: floor (mb {mb} vs {max(mb // 4, 64)}) {result['batched_vs_rebatched_floor'][j]}")
    return result


def bench_save(args, trainer, job_ids, device) -> dict:
    """Adapter save per job, in fp32 and in the model's dtype (what the real backend now writes)."""
    import torch

    root = Path(args.save_dir) if Path(args.save_dir).is_dir() else Path(tempfile.gettempdir())
    model_dtype = next(trainer.model.parameters()).dtype
    rows = {}
    for dtype in dict.fromkeys([torch.float32, model_dtype]):
        folder = Path(tempfile.mkdtemp(prefix="nodus_bench_save_", dir=root))
        times, size = [], 0
        try:
            for job_id in job_ids:
                t0 = time.perf_counter()
                trainer.save_adapter(job_id, str(folder / job_id), dtype=dtype)
                times.append(time.perf_counter() - t0)
                size = sum(f.stat().st_size for f in (folder / job_id).iterdir())
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        row = {"dir": str(root), "dtype": str(dtype), "per_job_s": [round(t, 4) for t in times],
               "mean_s": round(sum(times) / len(times), 4), "max_s": round(max(times), 4), "bytes_per_adapter": size}
        log(f"save ({dtype}): mean {row['mean_s']} s, max {row['max_s']} s per adapter ({size / 2**20:.1f} MiB)")
        rows[str(dtype).removeprefix("torch.")] = row
    first = next(iter(rows.values()))
    return {**first, "by_dtype": rows}


def bench_fused(args, trainer, batches, device) -> dict:
    """The best multi configuration again, with the elementwise ops compiled."""
    mb_tokens = args.fused_mb_tokens or max(args.mb_tokens)
    probe_job = next(iter(batches))
    probe = batches[probe_job]
    eager = trainer.logprobs(probe_job, probe)
    from real.fuse import fuse_elementwise

    compiled = fuse_elementwise(trainer.model)
    log(f"fused: compiled {compiled}; the first calls compile (a minute or two)")
    fused = trainer.logprobs(probe_job, probe)
    # Compiled kernels round differently; a wrong patch would differ by O(1), not O(1e-2).
    logprob_diff = max((a - b).abs().max().item() for a, b in zip(eager, fused))
    log(f"fused: max |logprob eager - fused| = {logprob_diff:.3g}")
    trainer.max_tokens_per_microbatch = mb_tokens
    tokens, completion = batch_tokens(batches)
    reset_peak(device)
    trainer.routing.layout_mode = args.fused_layout
    times = timed(lambda: trainer.train_step(batches), device, max(args.warmup, 2), args.iters)
    row = throughput(f"multi_{len(batches)}x_mb{mb_tokens}_fused_{args.fused_layout}", times, tokens, completion,
                     device, adapters=len(batches), mb_tokens=mb_tokens, compiled=compiled,
                     layout=args.fused_layout, max_abs_logprob_diff_vs_eager=logprob_diff)
    if args.profile:  # with the element-wise work fused, what is left: GEMMs, launches, the loss
        row["profile"] = profile_step(trainer, batches, device, f"{args.fused_layout}+compiled")
    return row


def bench_profile(args, trainer, batches, device) -> list[dict]:
    """One train_step per layout under torch.profiler (see ``profile_step``)."""
    trainer.max_tokens_per_microbatch = max(args.mb_tokens)
    mode = trainer.routing.layout_mode
    rows = []
    for layout in [x for x in args.layouts.split(",") if x]:
        trainer.routing.layout_mode = layout
        rows.append(profile_step(trainer, batches, device, layout))
    trainer.routing.layout_mode = mode
    return rows


def profile_step(trainer, batches, device, label: str) -> dict:
    """One train_step under torch.profiler (``real.profiling.profile_call``), after one unprofiled."""
    from real.profiling import profile_call

    trainer.train_step(batches)  # warm
    row = profile_call(lambda: trainer.train_step(batches), device, label)
    row["layout"] = label
    log(f"profile ({label}): wall {row['wall_s']:.3f} s, {row['kernels']} kernels {row['kernel_s']} s, "
        f"busy {row['gpu_busy']}")
    for k in row["top_kernels"][:12]:
        log(f"    {k['s']:.4f} s  x{k['calls']:5d}  {k['name']}")
    for name, ph in row["phases"].items():
        log(f"    phase {name}: cpu {ph['cpu_s']} s, device {ph['device_s']} s x{ph['calls']}")
    return row


def run_section(result, name, fn, out: Path) -> None:
    """Run one measurement; an error (out of memory, a compile failure) is recorded, not fatal,
    and the results so far are written after every section so a killed run still leaves data."""
    import torch

    try:
        result[name] = fn()
    except Exception as err:  # noqa: BLE001 - any failure is a result to report
        log(f"{name} FAILED: {type(err).__name__}: {err}")
        result[name] = {"error": f"{type(err).__name__}: {err}"[:2000]}
        if isinstance(err, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
    out.write_text(json.dumps(result, indent=2) + "\n")


def summarize(result) -> dict:
    def rate(section):
        row = result.get(section)
        return row.get("tokens_per_s_mean") if isinstance(row, dict) else None

    multi = [r for r in result.get("multi", []) if "tokens_per_s_mean" in r]
    best = max(multi, key=lambda r: r["tokens_per_s_mean"]) if multi else {}
    return {"multi_best_tokens_per_s": best.get("tokens_per_s_mean"), "multi_best_mb_tokens": best.get("mb_tokens"),
            "peak_gib_multi_best": best.get("peak_gib"), "multi_fused_tokens_per_s": rate("fused"),
            "one_adapter_tokens_per_s": rate("one_adapter"), "per_job_loop_tokens_per_s": rate("per_job_loop"),
            "peft_one_adapter_tokens_per_s": rate("peft")}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from real.trainer import MultiLoRATrainer

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"env": env_header(args, device), "dtype": str(dtype)}
    log(f"device {device} ({result['env']['gpu']}), {dtype}, torch {torch.__version__}")

    t0 = time.perf_counter()
    base = build_base(args, device, dtype)
    result["model"] = {"config": TINY if args.tiny else QWEN3_06B,
                       "params_m": round(sum(p.numel() for p in base.parameters()) / 1e6, 1),
                       "build_s": round(time.perf_counter() - t0, 2)}
    log(f"base built: {result['model']['params_m']}M params in {result['model']['build_s']} s")
    trainer = MultiLoRATrainer(base, logprob_chunk_tokens=args.chunk_tokens,
                               gradient_checkpointing=args.gradient_checkpointing,
                               max_tokens_per_microbatch=max(args.mb_tokens))
    if args.lengths_from:
        recorded = recorded_lengths(args.lengths_from, args.lengths_step)
        job_ids = sorted(recorded)[:args.jobs]
        batches = {j: recorded_batch(*recorded[j], trainer.vocab_size, seed=i) for i, j in enumerate(job_ids)}
        result["lengths"] = {j: {"prompt": recorded[j][0], "responses": recorded[j][1]} for j in job_ids}
        log(f"rows of {args.lengths_from} step {args.lengths_step}: {len(job_ids)} jobs")
    else:
        job_ids = [f"job{i}" for i in range(args.jobs)]
        batches = {j: make_batch(args, args.seqs_per_job, trainer.vocab_size, seed=i) for i, j in enumerate(job_ids)}
    for i, job_id in enumerate(job_ids):
        trainer.add_job(job_id, rank=args.rank, alpha=2 * args.rank, lr=1e-5, seed=i)

    run_section(result, "multi", lambda: bench_multi(args, trainer, batches, device), out)
    if args.profile:
        run_section(result, "profile", lambda: bench_profile(args, trainer, batches, device), out)
    run_section(result, "one_adapter", lambda: bench_one_adapter(args, trainer, batches, device), out)
    if not args.no_loop:
        run_section(result, "per_job_loop", lambda: bench_loop(args, trainer, batches, device), out)
    run_section(result, "equivalence", lambda: bench_equivalence(args, trainer, batches, device, dtype), out)
    run_section(result, "save", lambda: bench_save(args, trainer, job_ids, device), out)
    if args.peft:  # before fused: that one patches transformers' Qwen3 rotary function globally
        run_section(result, "peft", lambda: bench_peft(args, batches[job_ids[0]], device, dtype), out)
    if args.fused:
        run_section(result, "fused", lambda: bench_fused(args, trainer, batches, device), out)

    result["summary"] = summarize(result)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"summary {result['summary']}")
    log(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
