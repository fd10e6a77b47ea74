"""Tune vLLM's multi-LoRA Triton kernels (shrink, expand) for this GPU and a model's LoRA shapes.

vLLM runs its LoRA kernels with default block sizes unless ``VLLM_TUNED_CONFIG_FOLDER`` names a
folder of tuned configs (``vllm/lora/ops/triton_ops/README_TUNING.md``); none ship for the H200
and the Qwen3-0.6B shape. On the H200 a decode step of 256 sequences took 7.6 ms with 8 adapters
against 4.6 ms without LoRA (``shared/data/h200_phase_profile_2026-11-29.json``): the LoRA
kernels are ~40% of the engine's step, and the engine's generation is the overlap arm's critical
path. This script times each kernel on the shapes the engine runs (the model's q/k/v, o,
gate/up and down projections as vLLM slices them; decode batch sizes and prefill chunks; the
engine's adapter slots) over a small search space, keeps the fastest config per shape, and writes
the folder vLLM reads (``{GPU}_SHRINK.json``, ``{GPU}_EXPAND_TRUE.json``) plus a report of the
default config's time against the best one's per shape.

    python experiments/tune_lora_kernels.py --model-dir MODEL --out /tmp/lora-configs --report OUT.json
    # then: gpu_arms.py ... --engine-env VLLM_TUNED_CONFIG_FOLDER=/tmp/lora-configs (run keys get -ee)

Needs a CUDA GPU and vLLM (its Triton kernels); the config layout is checked on a CPU by
``tests/test_tune_lora.py`` through vLLM's own reader.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real.lora_kernels import config_files, lora_shapes, report_file  # noqa: E402  (lora_shapes: the tests')

# Decode batches (vLLM pads them to its CUDA-graph sizes) and prefill chunks; vLLM takes the
# nearest tuned batch size for any other.
DEFAULT_BATCHES = (1, 16, 32, 64, 128, 256, 512, 2048, 8192)


def search_space(op: str, rank: int, width: int) -> list[dict]:
    """Candidate kernel configs: the shrink op splits its long input width (``width``) across
    blocks (split_k), the expand op tiles its wide output (``width``); the rank is short."""
    configs = []
    # Kept small: each config compiles (~0.5 s, a few times over for Triton's integer
    # specialisations), and a device call is 10 minutes.
    if op == "shrink":
        for bm, bk, sk in itertools.product((16, 32, 64), (32, 64, 128, 256), (1, 8, 32)):
            if bk * sk > width:
                continue
            configs.append({"block_m": bm, "block_n": max(16, min(rank, 32)), "block_k": bk, "split_k": sk,
                            "num_warps": 4, "num_ctas": 1, "num_stages": 2, "group_size_m": 8})
    else:
        for bm, bn, stages in itertools.product((16, 32, 64), (64, 128, 256), (2, 3)):
            if bn > max(width, 64):
                continue
            warps = 4
            configs.append({"block_m": bm, "block_n": bn, "block_k": max(16, min(rank, 32)), "num_warps": warps,
                            "num_ctas": 1, "num_stages": stages})
    return configs


def key_width(op: str, shape: tuple, rank: int) -> tuple[int, int, int]:
    """(num_slices, k, n) as vLLM's ``get_lora_op_configs`` looks them up."""
    if op == "shrink":
        slices, width = shape
        return slices, width, rank
    return len(shape), rank, max(shape)


def put(table: dict, max_loras_key: int, slices: int, m: int, k: int, n: int, config: dict) -> None:
    """config_data[max_loras][num_slices][m][k][n] = config (vLLM's layout, string keys)."""
    (table.setdefault(str(max_loras_key), {}).setdefault(str(slices), {}).setdefault(str(m), {})
     .setdefault(str(k), {})[str(n)]) = config


def complete(tables: dict[str, dict], shapes: dict[str, list[tuple]], rank: int, max_loras_keys: list[int],
             default) -> None:
    """Give every (max_loras, num_slices) the engine can look up an entry: vLLM indexes
    num_slices exactly (a missing one is a KeyError in the engine), and a tuning cut short by its
    budget leaves some out. A missing one gets ``default(op, slices, k, n)`` (vLLM's own default)
    at batch 1; vLLM takes the nearest batch, width and rank of what is there."""
    for op, op_shapes in shapes.items():
        for key in max_loras_keys:
            for shape in op_shapes:
                slices, k, n = key_width(op, shape, rank)
                if str(slices) not in tables.setdefault(op, {}).get(str(key), {}):
                    put(tables[op], key, slices, 1, k, n, dict(default(op, key, slices, k, n)))


def write_configs(out: Path, gpu_name: str, tables: dict[str, dict]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for op, name in config_files(gpu_name).items():
        if tables.get(op):
            (out / name).write_text(json.dumps(tables[op], indent=1, sort_keys=True))
            paths.append(out / name)
    return paths


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the config folder (VLLM_TUNED_CONFIG_FOLDER)")
    p.add_argument("--report", type=Path, default=None, help="JSON: default against best time per shape")
    p.add_argument("--model-dir", type=Path, default=None, help="a model folder with config.json (default: Qwen3-0.6B's shape)")
    p.add_argument("--rank", type=int, default=16, help="the engine's max_lora_rank")
    p.add_argument("--max-loras", default="8", help="comma list: the engine's adapter slots to tune for (8 jobs: 8)")
    p.add_argument("--active", type=int, default=4, help="adapters active in a batch (tokens spread evenly)")
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=400.0, help="stop tuning new shapes after this long (the "
                   "configs found so far are written after every shape)")
    return p.parse_args(argv)


QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("tune_lora_kernels: needs a CUDA GPU (vLLM's LoRA kernels are Triton GPU kernels)")
    import vllm.lora.ops.triton_ops.lora_expand_op as expand_mod
    import vllm.lora.ops.triton_ops.lora_shrink_op as shrink_mod
    from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink
    from vllm.lora.ops.triton_ops.utils import get_lora_op_configs

    config = json.loads((args.model_dir / "config.json").read_text()) if args.model_dir else QWEN3_06B
    shapes = lora_shapes(config)
    dev, dt = torch.device("cuda"), torch.bfloat16
    gpu = torch.cuda.get_device_name()
    batches = [int(x) for x in args.batches.split(",") if x]
    tables: dict[str, dict] = {"shrink": {}, "expand": {}}
    report = {"gpu": gpu, "rank": args.rank, "active": args.active, "shapes": shapes, "rows": [],
              "torch": torch.__version__}
    max_loras_list = [int(x) for x in args.max_loras.split(",") if x]

    def vllm_default(op, key, slices, k, n, m=1):
        return get_lora_op_configs(op, max_loras=key, batch=m, hidden_size=k if op == "shrink" else n,
                                   rank=n if op == "shrink" else k, num_slices=slices,
                                   **({"add_inputs": True} if op == "expand" else {}))

    def write() -> list[Path]:
        complete(tables, shapes, args.rank, [m + 1 for m in max_loras_list], vllm_default)
        return write_configs(args.out, gpu, tables)

    chosen: dict = {}  # the config each op module is handed (patched over get_lora_op_configs)
    shrink_mod.get_lora_op_configs = expand_mod.get_lora_op_configs = (
        lambda *a, **kw: chosen["config"] if chosen.get("config") else get_lora_op_configs(*a, **kw))
    t_start = time.monotonic()

    def timed(fn) -> float:
        """Microseconds of GPU time per call: ``reps`` calls captured in one CUDA graph and replayed,
        as the engine replays them (launched one by one from Python, a ~10 us kernel would time
        the host instead)."""
        fn()  # compiles the config, fills vLLM's pointer caches
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if not report.get("eager_timing"):
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(args.reps):
                        fn()
                graph.replay()
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                return start.elapsed_time(end) / args.reps * 1e3
            except RuntimeError as err:  # the op would not capture: time it launched one by one
                report["eager_timing"] = repr(err)[:300]
                torch.cuda.synchronize()
        start.record()
        for _ in range(args.reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / args.reps * 1e3

    for max_loras in max_loras_list:
        active = min(args.active, max_loras)
        meta = LoRAKernelMeta.make(max_loras, max(batches), dev)
        for op, op_shapes in shapes.items():
            for shape in op_shapes:
                if time.monotonic() - t_start > args.budget_s:
                    report["stopped_at"] = {"max_loras": max_loras, "op": op, "shape": list(shape)}
                    break
                slices, k, n = key_width(op, shape, args.rank)
                if op == "shrink":
                    weights = tuple(torch.randn(max_loras, 1, args.rank, k, device=dev, dtype=dt) * 0.02
                                    for _ in range(slices))
                else:
                    weights = tuple(torch.randn(max_loras, 1, w, args.rank, device=dev, dtype=dt) * 0.02
                                    for w in shape)
                for m in batches:
                    mapping = (torch.arange(m, device=dev) % active).to(torch.int32)
                    meta.prepare_tensors(mapping)
                    margs = meta.meta_args(m, False)
                    if op == "shrink":
                        x = torch.randn(m, k, device=dev, dtype=dt)
                        y = torch.empty(slices, m, args.rank, device=dev, dtype=torch.float32)
                        call = (lambda x=x, y=y, margs=margs: lora_shrink(x, weights, y, *margs, 1.0))
                    else:
                        x = torch.randn(slices, m, args.rank, device=dev, dtype=torch.float32)
                        y = torch.zeros(m, sum(shape), device=dev, dtype=dt)
                        call = (lambda x=x, y=y, margs=margs: lora_expand(x, weights, y, *margs, offset_start=0,
                                                                          add_inputs=True))
                    chosen["config"] = None
                    default_us = timed(call)
                    best, best_us = None, float("inf")
                    for cand in search_space(op, args.rank, k if op == "shrink" else n):
                        chosen["config"] = cand
                        try:
                            us = timed(call)
                        except Exception:  # noqa: BLE001 - a config the GPU cannot run (resources)
                            continue
                        if us < best_us:
                            best, best_us = cand, us
                    chosen["config"] = None
                    if best is None or best_us >= default_us:  # never slower than vLLM's default
                        best, best_us = vllm_default(op, max_loras + 1, slices, k, n, m), default_us
                    # vLLM looks configs up by lora_ids' size: the engine's slots + 1 (no-adapter).
                    put(tables[op], max_loras + 1, slices, m, k, n, dict(best))
                    report["rows"].append({"op": op, "max_loras": max_loras, "slices": slices, "m": m, "k": k,
                                           "n": n, "default_us": round(default_us, 2), "best_us": round(best_us, 2),
                                           "speedup": round(default_us / best_us, 3)})
                    print(f"{op} L={max_loras} slices={slices} m={m} k={k} n={n}: default {default_us:.1f} us, "
                          f"best {best_us:.1f} us", flush=True)
                write()
                if args.report:
                    args.report.parent.mkdir(parents=True, exist_ok=True)
                    args.report.write_text(json.dumps(report, indent=1))
    report["files"] = [str(p) for p in write()]
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    # Beside the configs: what they were tuned for (rank, shapes), which real/lora_kernels.py checks
    # before an engine uses a shipped folder.
    (args.out / report_file(gpu)).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
