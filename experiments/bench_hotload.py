"""Measure the ways to hot-load a job's new LoRA adapter version into the shared vLLM engine.

For each method: how long `publish` takes, how long publish + a 1-token generate takes (what a
job waits between its optimizer step and its next rollouts), and whether the engine then samples
with the NEW weights: its greedy tokens must equal those of a never-loaded LoRARequest id for the
same folder (trivially fresh). Methods:
  fresh_id        new lora_int_id + name per version; add_lora, remove_lora of the old one
  inplace         one lora_int_id per job; add_lora(load_inplace=True) with the new path
  same_id_stale   one lora_int_id per job, new path, no load_inplace: vLLM keeps the old weights
  tensors         LoRARequest with in-memory tensors: recorded as supported or not, no timing

    python experiments/bench_hotload.py --out experiments/results/hotload_cpu.json
    python experiments/bench_hotload.py --model /path/to/model --rank 16 --out $OUT/hotload_gpu.json

Adapters are written straight as PEFT files (random A and B), so a large base model never has to be
loaded in HF. With `--load-format dummy` every adapter gives the same greedy tokens on random
weights: timings stay valid, the correctness column does not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA target module of a Qwen3/Llama-style decoder layer."""
    h = config["hidden_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    i = config["intermediate_size"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_random_adapter(base: Path, out: Path, rank: int, seed: int, std: float = 0.05, dtype=None) -> Path:
    """A PEFT LoRA adapter folder with random A and non-zero random B for every target module
    (``dtype``: the tensors' on file, default float32)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (fan_in, fan_out) in lora_shapes(config).items():
            part = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    out.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                      "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
                      "target_modules": list(TARGETS), "fan_in_fan_out": False,
                      "use_rslora": False, "use_dora": False, "modules_to_save": None,
                      "base_model_name_or_path": str(base)}
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def env_header(args) -> dict:
    import torch
    import vllm

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": gpu, "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "python": platform.python_version(),
            "vllm": vllm.__version__, "torch": torch.__version__,
            "argv": sys.argv[1:], "args": vars(args)}


def tensor_support() -> dict:
    from vllm.lora.request import LoRARequest

    fields = list(getattr(LoRARequest, "__struct_fields__", ()))
    tensor_fields = [f for f in fields if "tensor" in f and f != "tensorizer_config_dict"]
    return {"supported": bool(tensor_fields), "lora_request_fields": fields,
            "note": ("LoRARequest has no field for in-memory tensors; adapters are loaded from a "
                     "folder (tensorizer_config_dict, 0.26 only, deserializes a tensorizer file)")
            if not tensor_fields else f"tensor fields: {tensor_fields}"}


def greedy(engine, lora, prompt, tokens: int) -> tuple[int, ...]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True,
                        detokenize=False)
    out = engine.llm.generate([{"prompt_token_ids": prompt}], sp, lora_request=[lora],
                              use_tqdm=False)
    return tuple(out[0].outputs[0].token_ids)


def quartiles(xs: list[float]) -> dict:
    q1, q2, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0],) * 3
    return {"p25": q1, "median": q2, "p75": q3, "n": len(xs)}


def publish_and_check(engine, method: str, v: int, paths: list[Path], reference: dict,
                      prompt: list[int], check_tokens: int) -> dict:
    """Publish version v of the method's job, time it and a 1-token generate, check the weights."""
    from vllm.lora.request import LoRARequest

    from real.engine import GenRequest

    job, path = f"job-{method}", paths[v]
    t = time.monotonic()
    if method == "same_id_stale":
        # What a naive in-place reload does: same id, new path, nothing forces a reload.
        lora = LoRARequest(lora_name=f"{job}@v{v}", lora_int_id=9_000, lora_path=str(path))
        publish_s = time.monotonic() - t
        first = greedy(engine, lora, prompt, 1)[0]
    else:
        engine.hotload = method
        publish_s = engine.publish(job, v, path)
        lora = engine.lora_request(job)
        batch = engine.generate([GenRequest(job, v, [prompt], n=1, max_new_tokens=1,
                                            temperature=0.0)])[0]
        first = batch.completion_token_ids[0][0][0]
    publish_gen1_s = time.monotonic() - t
    got = greedy(engine, lora, prompt, check_tokens)
    return {"version": v, "publish_s": publish_s, "publish_plus_1_token_s": publish_gen1_s,
            "first_token": first, "correct": got == reference[path],
            "differs_from_previous_version": v == 0 or reference[path] != reference[paths[v - 1]]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' or a local model folder")
    p.add_argument("--tiny-dir", default=None, help="where to build the tiny model (cached)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--versions", type=int, default=20, help="versions published per method")
    p.add_argument("--check-tokens", type=int, default=8, help="greedy tokens compared per version")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--adapter-dir", default=None, help="where to write adapters (default: tmp)")
    p.add_argument("--out", default="experiments/results/hotload_cpu.json")
    args = p.parse_args(argv)

    from vllm.lora.request import LoRARequest

    from real.engine import GenRequest, MultiLoRAEngine
    from real.tiny import make_tiny_model

    work = Path(args.adapter_dir or tempfile.mkdtemp(prefix="nodus_hotload_"))
    base = (make_tiny_model(Path(args.tiny_dir or work / "tiny")) if args.model == "tiny"
            else Path(args.model))
    methods = ("fresh_id", "inplace", "same_id_stale")
    adapters = {m: [write_random_adapter(base, work / m / f"v{v}", args.rank, seed=100 * i + v)
                    for v in range(args.versions)] for i, m in enumerate(methods)}
    adapter_bytes = (adapters["fresh_id"][0] / "adapter_model.safetensors").stat().st_size

    t0 = time.monotonic()
    engine = MultiLoRAEngine(base, max_loras=len(methods), max_lora_rank=args.rank,
                             max_num_seqs=8, max_model_len=256, dtype=args.dtype,
                             load_format=args.load_format, enforce_eager=args.enforce_eager,
                             gpu_memory_utilization=args.gpu_memory_utilization,
                             skip_tokenizer_init=True)
    start_s = time.monotonic() - t0
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]

    # Reference tokens: each folder through a never-used id, removed right after.
    next_ref_id = 10_000
    reference = {}
    for m in methods:
        for path in adapters[m]:
            lora = LoRARequest(lora_name=f"ref:{path}", lora_int_id=next_ref_id,
                               lora_path=str(path))
            reference[path] = greedy(engine, lora, prompt, args.check_tokens)
            engine.llm.llm_engine.remove_lora(next_ref_id)
            next_ref_id += 1

    # Methods take turns version by version, so drift in machine speed hits them alike.
    rows = {m: [] for m in methods}
    for v in range(args.versions):
        for m in methods:
            rows[m].append(publish_and_check(engine, m, v, adapters[m], reference, prompt,
                                             args.check_tokens))
    results = {}
    for m in methods:
        steady = rows[m][1:]  # version 0 is the job's first load, not a swap
        results[m] = {
            "correct_all_versions": all(r["correct"] for r in steady),
            "publish_s": quartiles([r["publish_s"] for r in steady]),
            "publish_plus_1_token_s": quartiles([r["publish_plus_1_token_s"] for r in steady]),
            "versions": rows[m],
        }
    # Reference: a 1-token generate with an already-loaded adapter (what publish adds to).
    job = "job-fresh_id"
    v = engine.current_version(job)
    times = []
    for _ in range(5):
        t = time.monotonic()
        engine.generate([GenRequest(job, v, [prompt], n=1, max_new_tokens=1, temperature=0.0)])
        times.append(time.monotonic() - t)
    engine.close()

    correct = [m for m in ("fresh_id", "inplace") if results[m]["correct_all_versions"]]
    key = "publish_plus_1_token_s"
    ranked = sorted(correct, key=lambda m: results[m][key]["median"])
    winner = ranked[0] if ranked else None
    median = {m: results[m][key]["median"] for m in ranked}
    iqr = {m: results[m][key]["p75"] - results[m][key]["p25"] for m in ranked}
    tie = len(ranked) == 2 and median[ranked[1]] - median[ranked[0]] < max(iqr.values())
    report = {"env": dict(env_header(args), lora_kernel_configs=engine.lora_kernel_configs), "model": str(base),
              "rank": args.rank,
              "adapter_bytes": adapter_bytes, "engine_start_s": start_s,
              "generate_1_token_loaded_adapter_median_s": statistics.median(times),
              "methods": results, "tensors": tensor_support(),
              "fastest_correct": winner,
              "tie_within_noise": tie,  # median gap below the larger interquartile range
              "dummy_weights_warning": args.load_format == "dummy"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {m: {"correct": results[m]["correct_all_versions"],
                   "publish_ms": round(1e3 * results[m]["publish_s"]["median"], 3),
                   "publish_plus_1_token_ms": round(1e3 * results[m][key]["median"], 3)}
               for m in methods}
    print(json.dumps({"engine_start_s": start_s, "methods": summary, "fastest_correct": winner,
                      "tie_within_noise": tie, "tensors_supported": report["tensors"]["supported"]},
                     indent=2))
    return report


if __name__ == "__main__":
    main()
