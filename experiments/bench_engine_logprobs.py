"""What returning the sampled tokens' logprobs costs the engine (the logprob audit's engine side).

One vLLM engine (in-process, like nodus's engine worker) generates the same batch with every
request asking for logprobs (``logprobs=0``: the sampled token's), the same in vLLM's flat layout
(``flat_logprobs=True``: a few lists per request instead of a dict and a Logprob object per token),
none asking, and one request in eight asking (what ``--audit-responses 1`` asks at 8 responses a prompt;
nodus's engine asks in the default layout), also flat; forced lengths, no detokenisation, finished outputs only (as ``real.engine`` asks).
On a tiny model the decode step is host-bound, so this times the host's share of the per-step work:
what ``--audit-every N`` saves on the steps it leaves out and ``--audit-responses K`` on every step.

    python experiments/bench_engine_logprobs.py --out experiments/results/engine_logprobs_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="tiny", help="'tiny' (made locally) or a model folder")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from real.backend import resolve_model

    model = resolve_model(a.model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    llm = LLM(model=model, skip_tokenizer_init=True, max_num_seqs=a.requests, max_model_len=a.prompt_tokens + a.new_tokens + 8,
              enforce_eager=True, max_num_batched_tokens=max(65536, a.requests * a.prompt_tokens),
              logprobs_mode="raw_logprobs", **({"dtype": "float32"} if a.model == "tiny" else {}))
    prompts = [{"prompt_token_ids": [1 + (i * 7 + k) % (vocab - 2) for k in range(a.prompt_tokens)]}
               for i in range(a.requests)]
    asks = {"every request": (lambda i: 0, False), "every request, flat": (lambda i: 0, True),
            "none": (lambda i: None, False), "one in eight": (lambda i: 0 if i % 8 == 0 else None, False),
            "one in eight, flat": (lambda i: 0 if i % 8 == 0 else None, True)}

    def run(ask) -> float:
        which, flat = ask
        params = [SamplingParams(max_tokens=a.new_tokens, min_tokens=a.new_tokens, ignore_eos=True, logprobs=which(i),
                                 flat_logprobs=flat, temperature=1.0, output_kind=RequestOutputKind.FINAL_ONLY,
                                 detokenize=False)
                  for i in range(a.requests)]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    for ask in asks.values():  # warm-up
        run(ask)
    times = {name: [] for name in asks}
    for _ in range(a.repeats):  # interleaved, so drift in the host's speed hits every variant alike
        for name, ask in asks.items():
            times[name].append(run(ask))
    med = {k: statistics.median(v) for k, v in times.items()}
    import vllm

    report = {"env": {"vllm": vllm.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
                      "date": time.strftime("%Y-%m-%d")},
              "args": {k: str(v) for k, v in vars(a).items()}, "seconds": times, "median_s": med,
              "logprobs_cost": med["every request"] / med["none"] - 1,
              "flat_cost": med["every request, flat"] / med["none"] - 1,
              "one_in_eight_cost": med["one in eight"] / med["none"] - 1,
              "one_in_eight_flat_cost": med["one in eight, flat"] / med["none"] - 1}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: round(v, 3) for k, v in med.items()}),
          f"logprobs +{report['logprobs_cost']:.1%} (flat +{report['flat_cost']:.1%}), one in eight "
          f"+{report['one_in_eight_cost']:.1%} (flat +{report['one_in_eight_flat_cost']:.1%})")
    return report


if __name__ == "__main__":
    main()
