"""Build the provisional shipped profile from the first H200 measurements (shared/data).

    python -m calibration.provisional ../shared/data --out calibration/profiles/h200-qwen3-0.6b.json \
        --trainer-bench experiments/results/h200/bench_trainer_h200.json

Fits are relative-error least squares (a 10 ms step mispredicted by 1 ms matters as much as a
100 ms one by 10 ms). Every parameter that no measurement backs is listed under `assumptions`,
and every report names them until `nodus calibrate` replaces them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def fit_linear_rel(x: list[float], y: list[float]) -> tuple[float, float]:
    """Minimise sum(((a + b x) / y - 1)^2) over a, b >= 0 (noisy timings can pull either below 0:
    then the best fit on the boundary, a = 0 or b = 0, is taken)."""
    x, y = np.asarray(x, float), np.asarray(y, float)

    def loss(a: float, b: float) -> float:
        return float(np.sum(((a + b * x) / y - 1) ** 2))

    A = np.stack([1.0 / y, x / y], axis=1)
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(y), rcond=None)
    candidates = [(float(a), float(b))] if a >= 0 and b >= 0 else []
    candidates.append((0.0, float(np.sum(x / y) / np.sum((x / y) ** 2))))  # through the origin
    candidates.append((float(np.sum(1 / y) / np.sum(1 / y ** 2)), 0.0))  # constant
    return min(candidates, key=lambda ab: loss(*ab))


def apply_trainer_bench(prof: dict, bench: dict, name: str = "multi_8x_mb16384") -> dict:
    """Replace the trainer and adapter-save assumptions with nodus's own batched trainer, measured
    by experiments/bench_trainer.py (8 adapters in shared 16k-token micro-batches, AdamW included)."""
    run = next(r for r in bench["multi"] if r["name"] == name)
    s_per_token = sum(run["step_s"]) / len(run["step_s"]) / run["tokens"]
    prof["train"] = {"per_microbatch": {"a_s": 0.0, "b_s_per_unit": s_per_token}, "s_per_adapter": 0.0,
                     "max_profiled_tokens": run["mb_tokens"]}
    prof["publish"]["save_s_per_adapter"] = bench["save"]["mean_s"]
    gone = {"trainer-batched-rate", "trainer-per-adapter", "publish-save"}
    prof["assumptions"] = [a for a in prof["assumptions"] if a["id"] not in gone]
    prof["assumptions"].append({"id": "trainer-alone", "value": None,
                                "what": "trainer step time measured alone (benchmark, no engine beside it, eager "
                                        "kernels, no logprob audit); co-running is the sharing section's job"})
    prof["environment"]["sources"].append(f"bench_trainer ({bench['env']['date'][:10]}, torch {bench['env']['torch']})")
    prof["measurements"]["trainer_bench"] = {"name": name, "step_s": run["step_s"], "tokens": run["tokens"],
                                             "adapters": run["adapters"], "save": bench["save"]}
    return prof


def build(data_dir: Path) -> dict:
    phase = json.loads((data_dir / "h200_phase_profile_2026-11-29.json").read_text())
    coloc = json.loads((data_dir / "h200_colocation_2026-11-29.json").read_text())
    smoke = json.loads((data_dir / "h200_vllm_smoke_2026-11-29.json").read_text())

    curves = []
    for adapters in sorted({d["adapters"] for d in phase["decode"]}):
        pts = sorted((d["batch"], d["step_s"]) for d in phase["decode"] if d["adapters"] == adapters)
        curves.append({"adapters": adapters, "batch": [b for b, _ in pts], "step_s": [s for _, s in pts]})

    def prefill_fit(lora: bool):
        pts = [(d["tokens"], d["s"]) for d in phase["prefill"] if (d["adapters"] > 0) == lora]
        a, b = fit_linear_rel([p[0] for p in pts], [p[1] for p in pts])
        return {"a_s": a, "b_s_per_unit": b}

    train1 = [(d["tokens"], d["s"]) for d in phase["train"] if d["adapters"] == 1]
    ta, tb = fit_linear_rel([p[0] for p in train1], [p[1] for p in train1])

    # Rates in units of "alone, no MPS" work: each measured time is divided into the no-MPS alone time.
    nm, mp = coloc["nomps"], coloc["mps"]
    e0, t0 = nm["engine_batch_alone_s"], nm["trainer_step_alone_s"]
    sharing = {
        "none_corun": {"engine": e0 / nm["engine_batch_corun_s"], "trainer": t0 / nm["trainer_step_corun_s"]},
        "mps_alone": {"engine": e0 / mp["engine_batch_alone_s"], "trainer": t0 / mp["trainer_step_alone_s"]},
        "mps_corun": {"engine": e0 / mp["engine_batch_corun_s"], "trainer": t0 / mp["trainer_step_corun_s"]},
    }
    n_adapters_saved = 8
    return {
        "schema": "nodus.profile/1",
        "environment": {
            "gpu": coloc["gpu"], "model": "Qwen3-0.6B shape (dummy weights)", "vllm": coloc["vllm"],
            "torch": coloc["torch"], "driver": None, "date": coloc["date"], "git_commit": None,
            "sources": sorted(p.name for p in data_dir.glob("h200_*.json")),
        },
        "decode": {"curves": curves, "s_per_context_token": 0.0},
        "prefill": {"no_lora": prefill_fit(False), "lora": prefill_fit(True)},
        "train": {"per_microbatch": {"a_s": ta, "b_s_per_unit": tb}, "s_per_adapter": 0.005,
                  "max_profiled_tokens": max(p[0] for p in train1)},
        "publish": {"save_s_per_adapter": smoke["adapter_save_all_s"] / n_adapters_saved,
                    "engine_load_s": smoke["hot_reload_plus_1tok_s"]},
        "sharing": sharing,
        "assumptions": [
            {"id": "decode-context", "value": 0.0,
             "what": "decode step time does not depend on KV context length (measured at one context length only)"},
            {"id": "trainer-batched-rate", "value": tb,
             "what": "the batched multi-adapter trainer runs at PEFT's measured one-adapter token rate "
                     "(PEFT's mixed-adapter path, 5x slower, is not what nodus runs)"},
            {"id": "trainer-per-adapter", "value": 0.005,
             "what": "optimizer step and bookkeeping cost 5 ms per adapter in a step (not measured)"},
            {"id": "publish-save", "value": smoke["adapter_save_all_s"] / n_adapters_saved,
             "what": "saving an adapter costs the measured disk save of 8 adapters / 8 and does not use the GPU"},
            {"id": "prefill-lora-any", "value": None,
             "what": "prefill with 1..N adapters costs as the 8-adapter measurement"},
            {"id": "sharing-constant", "value": None,
             "what": "co-run and MPS slowdowns are the one measured configuration's, for every batch size and token count"},
            {"id": "sharing-many-clients", "value": None,
             "what": "more than two co-running clients split the measured pair's combined rate in proportion "
                     "to the pair's rates (timeslice arm)"},
        ],
        "measurements": {"colocation": coloc, "smoke": smoke, "train": phase["train"], "prefill": phase["prefill"]},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--trainer-bench", type=Path, help="bench_trainer JSON to take the trainer rate from")
    args = ap.parse_args(argv)
    prof = build(args.data_dir)
    if args.trainer_bench:
        prof = apply_trainer_bench(prof, json.loads(args.trainer_bench.read_text()))
    args.out.write_text(json.dumps(prof, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
