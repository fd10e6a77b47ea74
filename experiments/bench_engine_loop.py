"""Where does the engine's time go? `LLM.generate` against nodus's own step loop, with and without
per-response sampling seeds, for one batch of many adapters' requests.

    python experiments/bench_engine_loop.py --model PATH --batch 512 --adapters 8 --length 128 --out OUT.json

The real backend steps vLLM itself (submit + step) so groups share the batch and publishes land
between steps; on the H200 its generation ran ~5x slower than the profile's `LLM.generate`. This
isolates the two suspects: the loop, and seeded sampling (vLLM samples seeded requests one
generator at a time). On the CPU (tiny model, 64 sequences x 64 tokens, 4 adapters) the loop took
0.96 s against generate's 0.99 s, seeded or not.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local model folder with saved weights")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--engine-memory", type=float, default=0.4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch

    from real.engine import GenRequest, MultiLoRAEngine
    from real.trainer import MultiLoRATrainer
    from real.workers import load_base_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    trainer = MultiLoRATrainer(load_base_model(args.model, "auto", getattr(torch, dtype), device),
                               device=device, base_model_name_or_path=args.model)
    root = tempfile.mkdtemp(prefix="nodus-loop-")
    for a in range(args.adapters):
        trainer.add_job(f"j{a}", rank=args.rank, alpha=2 * args.rank, lr=1e-5, seed=a)
        trainer.save_adapter(f"j{a}", f"{root}/j{a}/v0")
    vocab = trainer.vocab_size
    del trainer
    if device == "cuda":
        torch.cuda.empty_cache()
    extra = {"max_num_batched_tokens": 65536} if device == "cpu" else {}
    eng = MultiLoRAEngine(args.model, max_loras=args.adapters, max_lora_rank=args.rank, max_num_seqs=args.batch,
                          gpu_memory_utilization=args.engine_memory, enforce_eager=args.enforce_eager,
                          skip_tokenizer_init=True, dtype=dtype, **extra)
    for a in range(args.adapters):
        eng.publish(f"j{a}", 0, f"{root}/j{a}/v0")
    per = args.batch // args.adapters

    def reqs(seed):
        return [GenRequest(f"j{a}", 0, [[(7 * a + i) % (vocab - 2) + 1 for i in range(args.prompt_tokens)]] * per,
                           n=1, max_new_tokens=args.length, seed=seed, forced_lengths=[args.length] * per)
                for a in range(args.adapters)]

    def loop(r):
        eng.submit("bench", r)
        while eng.has_unfinished():
            eng.step()

    results = {}
    for seeded in (False, True):
        for name, fn in (("generate", eng.generate), ("step_loop", loop)):
            seed = 1 if seeded else None
            fn(reqs(seed))  # warm-up at this shape
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn(reqs(seed))
                times.append(time.perf_counter() - t0)
            key = f"{name}_{'seeded' if seeded else 'unseeded'}"
            results[key] = {"s": times, "tokens_per_s": args.batch * args.length / min(times)}
            print(f"{key}: {min(times):.3f} s ({results[key]['tokens_per_s']:.0f} tok/s)", flush=True)
    env = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    try:
        import vllm

        env["vllm"] = vllm.__version__
    except ImportError:
        pass
    with open(args.out, "w") as f:
        json.dump({"env": dict(env, lora_kernel_configs=eng.lora_kernel_configs), "results": results}, f, indent=1)
    eng.close()


if __name__ == "__main__":
    main()
