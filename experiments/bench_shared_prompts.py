"""The trainer's step with each prompt computed once (``share_prompts``) against plain rows, on a
recorded run's lengths in GRPO's shape (each prompt's responses share its tokens).

One trainer (Qwen3-0.6B shape, random bf16 weights, element-wise ops compiled as in a run, graphed
micro-batches on a GPU), the same jobs and rows for every variant: a variant's first step builds
(captures) its programs, the next ``--iters`` are timed; then, from one saved state of the jobs,
one step plain and one step shared, and how far the shared update lands from the plain one (bf16:
compare with the graphed-against-eager spread, ~8%, in experiments/results/h200/session10/).

    python experiments/bench_shared_prompts.py --lengths-from RUN_DIR --out OUT.json
    python experiments/bench_shared_prompts.py --tiny --out /tmp/shared_tiny.json   # CPU: 'static' mode
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.bench_trainer import (QWEN3_06B, TINY, add_recorded_bench_args, env_header,  # noqa: E402
                                       recorded_lengths)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_recorded_bench_args(p, jobs="4,1", iters=3)
    p.add_argument("--share", default="0,8,4,2", help="comma list: share_prompts of each variant (0: plain rows)")
    p.add_argument("--responses-per-prompt", type=int, default=8)
    args = p.parse_args(argv)
    try:
        args.share_list = [int(x) for x in args.share.split(",") if x]
        args.job_list = [int(x) for x in args.jobs.split(",") if x]
    except ValueError:
        p.error(f"--share {args.share!r} and --jobs {args.jobs!r} take comma lists of integers")
    if not args.share_list or any(s < 0 for s in args.share_list) or 0 not in args.share_list:
        p.error(f"--share {args.share!r}: integers >= 0, including 0 (the plain rows every variant is held against)")
    if not args.job_list or any(n < 1 for n in args.job_list) or args.responses_per_prompt < 1 or args.iters < 1:
        p.error("--jobs >= 1 each, --responses-per-prompt >= 1 and --iters >= 1")
    return args


def grouped_rows(prompt: int, responses: list[int], per_prompt: int, vocab: int, seed: int):
    """A JobBatch in GRPO's shape: consecutive runs of ``per_prompt`` responses share one random
    prompt of ``prompt`` tokens; each response's length as given; random advantages."""
    import numpy as np

    from real.trainer import JobBatch

    rng = np.random.default_rng(seed)
    ids, mask, p = [], [], None
    for i, r in enumerate(responses):
        if i % per_prompt == 0:
            p = rng.integers(0, vocab, prompt).tolist()
        ids.append(p + rng.integers(0, vocab, r).tolist())
        mask.append([0] * prompt + [1] * r)
    return JobBatch(ids, mask, rng.normal(size=len(responses)).tolist())


def rows_for(args, n_jobs: int, vocab: int) -> tuple[dict, list]:
    import numpy as np

    if args.lengths_from:
        rec = recorded_lengths(args.lengths_from, args.step)
        jobs = sorted(rec, key=lambda j: int("".join(c for c in j if c.isdigit()) or 0))
        picked = [rec[jobs[k % len(jobs)]] for k in range(n_jobs)]
    else:
        rng = np.random.default_rng(args.seed)
        prompt, room, n = (8, 24, 16) if args.tiny else (90, 256, 64)
        picked = [(prompt, [int(x) for x in np.clip(rng.lognormal(np.log(room / 2.5), 0.8, n), 1, room)])
                  for _ in range(n_jobs)]
    batches = {f"job{k}": grouped_rows(p, r, args.responses_per_prompt, vocab, seed=args.seed + k)
               for k, (p, r) in enumerate(picked)}
    return batches, [[int(p), [int(x) for x in r]] for p, r in picked]


def make_trainer(args, device, dtype):
    import torch
    import transformers

    from real.fuse import fuse_elementwise
    from real.trainer import MultiLoRATrainer

    torch.manual_seed(args.seed)
    config = transformers.Qwen3Config(**(TINY if args.tiny else QWEN3_06B))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    if device.type == "cuda":
        fuse_elementwise(model)
    mode = "graphed" if device.type == "cuda" else "static"
    # The largest share asked for: the model check runs once, at construction.
    return MultiLoRATrainer(model, max_tokens_per_microbatch=args.mb_tokens, step_mode=mode,
                            share_prompts=max(args.share_list))


def tokens_of(batches, share: int) -> int:
    """Tokens the model runs a step on: every row's, or each packed group's once."""
    from real.graphed import packed_length, prompt_groups
    from real.trainer import _validate

    total = 0
    for j, b in batches.items():
        s = _validate(j, b, 1 << 62)
        if share > 1:
            total += sum(packed_length(s.ids, s.positions, g) for g in prompt_groups(s.ids, s.positions, share))
        else:
            total += sum(len(r) for r in s.ids)
    return total


def run_case(args, t, n_jobs: int, device) -> dict:
    import torch

    batches, lengths = rows_for(args, n_jobs, t.vocab_size)
    for k in range(n_jobs):
        t.add_job(f"job{k}", rank=args.rank, alpha=2 * args.rank, lr=1e-4, seed=100 + k)
    # lengths: each job's [prompt tokens, response lengths], so a fit of the packed attention
    # (nodus fit-packed) rebuilds the rows without the run folder
    out = {"jobs": n_jobs, "lengths": lengths, "variants": {}}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for share in args.share_list:
        t.set_share_prompts(share)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(1 + args.iters):
            sync()
            t0 = time.perf_counter()
            t.train_step(batches)
            sync()
            times.append(time.perf_counter() - t0)
        steps = sorted(times[1:])
        out["variants"][str(share)] = {
            "first_step_s": round(times[0], 4), "step_s": [round(x, 4) for x in times[1:]],
            "median_s": round(steps[len(steps) // 2], 4), "model_tokens": tokens_of(batches, share),
            "microbatches": t.last_microbatches, "graph_error": t.graph_error,
            "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None}
        print(f"[{n_jobs} jobs] share {share}: {out['variants'][str(share)]}", flush=True)
    plain = out["variants"]["0"]["median_s"]
    for v in out["variants"].values():
        v["speedup"] = round(plain / v["median_s"], 3)
    out["update_rel_diff"] = agreement(args, t, batches)
    for k in range(n_jobs):
        t.remove_job(f"job{k}")
    return out


def agreement(args, t, batches) -> dict:
    """From one saved state of the jobs: ||shared update - plain update|| / ||plain update||, max
    over jobs, per shared variant."""
    import torch

    def flat(j):
        return torch.cat([p.detach().float().flatten() for p in t.adapter(j).parameters()])

    saved = {j: t.state_dict_job(j) for j in batches}
    start = {j: flat(j) for j in batches}
    updates = {}
    for share in args.share_list:
        for j, st in saved.items():
            t.load_state_job(j, st)
        t.set_share_prompts(share)
        t.train_step(batches)
        updates[share] = {j: flat(j) - start[j] for j in batches}
    return {str(s): max(float((u[j] - updates[0][j]).norm() / updates[0][j].norm().clamp_min(1e-30)) for j in u)
            for s, u in updates.items() if s != 0}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    t = make_trainer(args, device, dtype)
    result = {"env": env_header(args, device), "cases": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for n in args.job_list:
        result["cases"].append(run_case(args, t, n, device))
        out.write_text(json.dumps(result, indent=1) + "\n")  # a call cut short keeps what it measured
    for c in result["cases"]:
        print(json.dumps({"jobs": c["jobs"], "speedup": {s: v["speedup"] for s, v in c["variants"].items()},
                          "model_tokens": {s: v["model_tokens"] for s, v in c["variants"].items()},
                          "update_rel_diff": c["update_rel_diff"]}))
    return result


if __name__ == "__main__":
    main()
