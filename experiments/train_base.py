"""Pretrain a base model for the real backend: `python experiments/train_base.py --size tiny --out DIR`.

A thin CLI over `real.base_model.train_base`: builds the char tokenizer and a Qwen3 causal LM,
pretrains it on the 8 task families' training items, reports per-family sampled accuracy
(temperature 1.0) and saves everything (model, tokenizer, base_model.json) into a new folder.
tiny: ~4 min on 2 CPU cores; small: 2000 steps on one H200 (`--device cuda`, bf16 autocast).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install


def main(argv: list[str] | None = None) -> dict:
    from real.base_model import SIZES, train_base

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the size's)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="torch CPU threads; 0 leaves torch's default (1 is fastest on a busy machine)")
    ap.add_argument("--corrupt-frac", type=float, default=None,
                    help="fraction of training answers made wrong (default: the size's)")
    ap.add_argument("--eval-samples", type=int, default=None, help="samples per eval item")
    args = ap.parse_args(argv)
    overrides = {k: v for k, v in (("corrupt_frac", args.corrupt_frac),
                                   ("eval_samples", args.eval_samples)) if v is not None}
    report = train_base(args.out, size=args.size, steps=args.steps, seed=args.seed,
                        device=args.device, cpu_threads=args.cpu_threads or None, **overrides)
    print(json.dumps({"accuracy": report["accuracy"], "params": report["params"],
                      "size_mb": report["size_mb"], "wall_s": report["wall_s"]}, indent=1))
    return report


if __name__ == "__main__":
    main()
