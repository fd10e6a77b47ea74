"""`nodus calibrate`: measure a profile's engine and trainer costs with the real backend's parts.

    nodus calibrate --model PATH --out PROFILE.json [--base h200-qwen3-0.6b] [--batches 8,64,256,512]

In one process (no co-running): decode step time against running batch and distinct adapters
(two forced response lengths per point; the difference cancels prefill and call overhead), KV
context cost (two prompt lengths), prefill against tokens, trainer step against tokens and
adapters, adapter save and engine load. Fits go into the profile schema the simulator reads;
the sharing section (co-run and MPS rates, two processes) is kept from `--base` and stays listed
as an assumption of this profile until measured.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from calibration.provisional import fit_linear_rel
from nodus.outdir import git_commit, host


KL_BETA = 0.04  # the KL coefficient of the calibration's KL step (its cost does not depend on it)


def _train_batches(adapters: int, tokens: int, vocab: int, rng, seq: int = 256) -> dict:
    """About `tokens` tokens of random rows of `seq` tokens (the first quarter prompt) split evenly
    over the calibration jobs cal0..cal{adapters-1}."""
    from real.trainer import JobBatch

    rows = max(1, tokens // seq // adapters)
    return {f"cal{j}": JobBatch(input_ids=[[int(t) for t in rng.integers(1, vocab - 1, size=seq)] for _ in range(rows)],
                                completion_mask=[[0] * (seq // 4) + [1] * (seq - seq // 4)] * rows,
                                advantages=rng.standard_normal(rows).tolist())
            for j in range(adapters)}


def environment(device: str) -> dict:
    """The header of a measurement: GPU (or CPU) and its driver, torch and vLLM versions, date, git commit."""
    import torch

    from nodus.gpumemory import gpu_driver

    on_gpu = device.startswith("cuda")
    env = {"gpu": torch.cuda.get_device_name(0) if on_gpu else f"cpu ({platform.processor() or 'unknown'})",
           "driver": gpu_driver() if on_gpu else None,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "git_commit": git_commit(),
           "host": host()}
    try:
        import vllm

        env["vllm"] = vllm.__version__
    except ImportError:
        pass
    return env


def _requests(adapters: int, batch: int, prompt_tokens: int, length: int, vocab: int, rng):
    from real.engine import GenRequest

    per = [batch // adapters + (1 if a < batch % adapters else 0) for a in range(adapters)]
    reqs = []
    for a, n in enumerate(per):
        if n == 0:
            continue
        prompts = [[int(t) for t in rng.integers(1, max(2, vocab - 1), size=prompt_tokens)] for _ in range(n)]
        reqs.append(GenRequest(job_id=f"cal{a}", adapter_version=0, prompts=prompts, n=1, max_new_tokens=length,
                               temperature=1.0, seed=None, forced_lengths=[length] * n))
    return reqs


def _timed_no_lora(eng, reqs) -> float:
    """Seconds for the requests' prompts sampled with no LoRA request (the base model alone)."""
    prompts, params, _, _ = eng._expand(reqs)
    t0 = time.perf_counter()
    eng.llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


# The engine's share of the GPU while a calibration measures (vLLM gpu_memory_utilization): its KV
# cache stays allocated while the trainer is timed after it.
CAL_ENGINE_MEMORY = 0.4
# The train points' token counts unless told; the larger is the trainer's micro-batch.
CAL_TRAIN_TOKENS = (4096, 16384)


def calibration_train_tokens(asked: tuple[int, ...] | None, memory: tuple[float, float] | None, graphed: bool,
                             log=print) -> tuple[int, ...]:
    """The train points' token counts: ``asked``, else CAL_TRAIN_TOKENS with its larger count the
    largest halving of it whose graphed trainer fits beside the calibration's engine in ``memory``
    (free, total GiB; ``nodus.gpumemory``, as a run's default micro-batch is fitted) and the smaller
    under it. On an H100 80GB that is 4096 and 8192: session 70's capture of 16384 tokens there ran
    out of memory and left the trainer eager. A graphed ``asked`` size that is not expected to fit
    is kept, with a warning (its capture may fail: the points after it are then left out of the
    train terms, ``train_points``)."""
    from nodus.gpumemory import fitted_microbatch, microbatch_that_fits

    if not graphed or memory is None:
        return tuple(asked) if asked else CAL_TRAIN_TOKENS
    if asked:
        fits = microbatch_that_fits(memory[0], memory[1], CAL_ENGINE_MEMORY, 1, max(asked))
        if fits != max(asked):
            log(f"--train-tokens {','.join(map(str, asked))}: a graphed trainer of {max(asked)}-token micro-batches "
                f"is not expected to fit beside the engine in {memory[0]:.0f} GiB free "
                f"({'none fits' if fits is None else f'{fits} tokens would'}); if its capture fails, the points "
                "timed eager after it are left out of the train terms")
        return tuple(asked)
    mb = fitted_microbatch(max(CAL_TRAIN_TOKENS), 1, memory, CAL_ENGINE_MEMORY)
    if mb == max(CAL_TRAIN_TOKENS):
        return CAL_TRAIN_TOKENS
    tokens = (min(min(CAL_TRAIN_TOKENS), mb // 2), mb)
    log(f"train points at {tokens[0]} and {tokens[1]} tokens: the largest micro-batch a graphed trainer is expected "
        f"to fit beside the engine in {memory[0]:.0f} GiB free (nodus.gpumemory)")
    return tokens


def measure(model: str, batches: list[int], adapter_counts: list[int], prompt_tokens: tuple[int, int],
            lengths: tuple[int, int], train_tokens: list[int], device: str, dtype: str, rank: int = 16,
            engine_memory: float = CAL_ENGINE_MEMORY, enforce_eager: bool = False, repeats: int = 3, log=print,
            trainer_graphs: bool = False, tuned_lora_kernels: bool = True, engine_slots: int | None = None,
            adapter_format: str = "safetensors") -> dict:
    """Raw timings (seconds) from one engine and one trainer in this process (``trainer_graphs``:
    the trainer's micro-batches as CUDA graphs, the fixed-shape program uncaptured on a CPU).
    ``engine_slots``: the engine's adapter slots (vLLM max_loras; default the largest adapter count), as
    the runs it should describe start theirs (one per job of the invocation's largest arm).
    ``adapter_format``: the handoff whose save and publish are timed (``RealOptions.adapter_format``)."""
    check_adapter_format(adapter_format)
    import torch

    from real.engine import MultiLoRAEngine
    from real.workers import load_base_model
    from real.trainer import MultiLoRATrainer

    tdtype = getattr(torch, dtype)
    base = load_base_model(model, "auto", tdtype, device)
    from real.backend import trainer_step_mode

    trainer = MultiLoRATrainer(base, device=device, max_tokens_per_microbatch=max(train_tokens),
                               base_model_name_or_path=model,
                               step_mode=trainer_step_mode(trainer_graphs, "cuda" if device.startswith("cuda") else "cpu"))
    # The trainer the runs use: on a GPU its element-wise ops compiled (the warm-up step before each
    # timed one compiles them), the default multi-adapter layout.
    from real.fuse import compile_wanted, fuse_elementwise

    compiled = fuse_elementwise(base) if compile_wanted(None, device) else []
    asked_mode = trainer.step_mode
    vocab = trainer.vocab_size
    ad_dir = Path(tempfile.mkdtemp(prefix="nodus-cal-"))
    n_ad = max(adapter_counts)
    slots = n_ad if engine_slots is None else engine_slots  # calibrate() refuses fewer, before loading
    save_s = []
    for a in range(n_ad):
        trainer.add_job(f"cal{a}", rank=rank, alpha=2 * rank, lr=1e-5, seed=a)
        t0 = time.perf_counter()
        trainer.save_adapter(f"cal{a}", str(ad_dir / f"cal{a}" / "v0"), adapter_format=adapter_format)
        save_s.append(time.perf_counter() - t0)
    # On a GPU, room for a batch past vLLM's default graphs (at most 512 tokens; the larger max_num_seqs
    # changes no measured point: each is graphed either way, each prefill past the graphs either way).
    graphless_batch = max(2 * max(batches), 1024) if device.startswith("cuda") and not enforce_eager else 0
    eng = MultiLoRAEngine(model, max_loras=slots, max_lora_rank=rank,
                          max_num_seqs=max(max(batches), graphless_batch),
                          gpu_memory_utilization=engine_memory, enforce_eager=enforce_eager,
                          tuned_lora_kernels=tuned_lora_kernels,
                          skip_tokenizer_init=True, dtype=dtype if device != "cpu" else "float32",
                          **({"max_num_batched_tokens": 65536} if device == "cpu" else {}))
    load_s = [eng.publish(f"cal{a}", 0, ad_dir / f"cal{a}" / "v0") for a in range(n_ad)]
    rng = np.random.default_rng(0)

    def timed(reqs) -> float:
        t0 = time.perf_counter()
        eng.generate(reqs)
        return time.perf_counter() - t0

    l1, l2 = lengths

    def step_time(a: int, b: int, p: int, time_fn=None) -> tuple[float, float, float]:
        """(decode step, short call, long call), medians over `repeats` interleaved pairs after one
        untimed call: the two lengths' difference cancels prefill and call overhead."""
        time_fn = time_fn or timed
        # One untimed call at the point's shapes first: kernels compiled for a new batch (Triton
        # LoRA kernels, the logprob kernel) compile there, not inside a timed pair (session 21's
        # calibration compiled LoRA kernels inside the 1-adapter, 512-sequence pairs).
        time_fn(_requests(a, b, p, l1, vocab, rng))
        t1s, t2s = [], []
        for _ in range(repeats):
            t1s.append(time_fn(_requests(a, b, p, l1, vocab, rng)))
            t2s.append(time_fn(_requests(a, b, p, l2, vocab, rng)))
        t1, t2 = float(np.median(t1s)), float(np.median(t2s))
        return max((t2 - t1) / (l2 - l1), 1e-6), t1, t2

    timed(_requests(1, 2, prompt_tokens[0], 2, vocab, rng))  # warm-up (kernel compiles, graphs)
    decode, context, prefill = [], [], []
    for a in adapter_counts:
        for b in batches:
            step, t1, t2 = step_time(a, b, prompt_tokens[0])
            decode.append({"batch": b, "adapters": a, "step_s": step, "t_short_s": t1, "t_long_s": t2})
            prefill.append({"tokens": b * prompt_tokens[0], "adapters": a, "s": max(t1 - l1 * step, 0.0)})
            log(f"decode batch {b:4d} adapters {a}: {step * 1e3:.2f} ms/step")
        b = batches[-1]
        step_long, t1, _ = step_time(a, b, prompt_tokens[1])
        step_short = next(d["step_s"] for d in decode if d["batch"] == b and d["adapters"] == a)
        context.append({"batch": b, "adapters": a, "prompt_tokens": list(prompt_tokens),
                        "step_s": [step_short, step_long],
                        "s_per_context_token": max((step_long - step_short) / (b * (prompt_tokens[1] - prompt_tokens[0])), 0.0)})
        prefill.append({"tokens": b * prompt_tokens[1], "adapters": a, "s": max(t1 - l1 * step_long, 0.0)})
    # Past the CUDA-graph sizes (a GPU engine with graphs): the step a mid-batch admission at a
    # nearly full batch runs without them (sim: decode.graphless).
    graph_max = eng.graph_max_tokens()
    graphless = []
    if graph_max is None or graphless_batch <= graph_max:
        log(f"no decode step past the CUDA graphs measured (graphs up to {graph_max} tokens, "
            f"batch {graphless_batch})")
    else:
        for a in adapter_counts:
            step, _, _ = step_time(a, graphless_batch, prompt_tokens[0])
            graphless.append({"batch": graphless_batch, "adapters": a, "step_s": step})
            log(f"decode batch {graphless_batch:4d} adapters {a} (past the {graph_max}-token graphs): "
                f"{step * 1e3:.2f} ms/step")
    # The same decode with no adapter at all (the LoRA overhead against the plain model).
    no_lora = []
    for b in (batches[0], batches[-1]):
        step, _, _ = step_time(1, b, prompt_tokens[0], time_fn=lambda reqs: _timed_no_lora(eng, reqs))
        no_lora.append({"batch": b, "step_s": step})
        log(f"decode batch {b:4d} no LoRA: {no_lora[-1]['step_s'] * 1e3:.2f} ms/step")
    eng.close()

    def timed_step(batches_) -> float:
        """Seconds of one train step at this shape, after an untimed warm-up step at it."""
        trainer.train_step(batches_)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train_step(batches_)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    train = []
    for a in adapter_counts:
        for tokens in train_tokens:
            batches_ = _train_batches(a, tokens, vocab, rng)
            s = timed_step(batches_)
            # The mode this point was timed in: a graph capture that fails (out of memory beside the
            # engine, say) leaves the trainer eager from then on (fit_profile keeps the asked mode's points).
            train.append({"tokens": sum(len(r) for b in batches_.values() for r in b.input_ids), "adapters": a, "s": s,
                          "step_mode": trainer.step_mode})
            log(f"train {train[-1]['tokens']:6d} tokens, {a} adapters: {s:.3f} s")
    # The KL term (jobs[].beta > 0): the same step with every job's beta on adds a forward pass of
    # the base model over the job's tokens (its reference logprobs); train.kl_share prices it.
    a, tokens = max(adapter_counts), max(train_tokens)
    for j in range(a):
        trainer.add_job(f"kl{j}", rank=rank, alpha=2 * rank, lr=1e-5, seed=j, beta=KL_BETA)
    plain = _train_batches(a, tokens, vocab, rng)
    with_kl = {f"kl{k[3:]}": b for k, b in plain.items()}
    times = {"plain_s": timed_step(plain), "s": timed_step(with_kl)}
    train_kl = {"tokens": sum(len(r) for b in plain.values() for r in b.input_ids), "adapters": a, "beta": KL_BETA,
                **times, "step_mode": trainer.step_mode}
    log(f"train {train_kl['tokens']:6d} tokens, {a} adapters, beta {KL_BETA}: {times['s']:.3f} s "
        f"(without: {times['plain_s']:.3f} s)")
    return {"decode": decode, "decode_no_lora": no_lora, "context": context, "prefill": prefill, "train": train,
            "train_kl": train_kl, "graph_max_tokens": graph_max, "graphless": graphless,
            "save_s": save_s, "load_s": load_s, "adapter_format": adapter_format, "rank": rank,
            "train_mb_tokens": max(train_tokens),
            "engine_max_loras": slots,
            # The engine's LoRA kernel configs (None: vLLM's defaults): the engine terms describe them.
            "lora_kernel_configs": eng.lora_kernel_configs,
            # step_mode as trained (a graph capture that failed left it eager).
            "trainer": {"lora_layout": trainer.routing.layout_mode, "compiled": compiled,
                        "step_mode": trainer.step_mode, "step_mode_asked": asked_mode,
                        "graph_error": trainer.graph_error}}


DECODE_MODELS = ("surface", "points")
DECODE_OUTLIER = 0.25  # a measured decode point this far from the fitted surface is named in the profile


def fit_decode_surface(decode: list[dict]) -> dict:
    """The graphed decode step as a + b*batch + c*adapters + d*batch*adapters, every term >= 0 (a
    step never gets cheaper with more sequences or more adapters), by relative-error least squares
    over the measured points (``decode`` rows: batch, adapters, step_s). Returns the coefficients,
    each point's fitted seconds and relative error, and the points more than DECODE_OUTLIER off.
    (Session 21's H200 points were not monotone in adapters: 4 adapters measured 11.8 / 23.3 ms at
    256 / 512 sequences, 8 adapters 9.2 / 16.2; an 8-job group's generation read the 4-adapter row.)"""
    from calibration.fit_runs import nonneg_rel_lstsq

    b = np.array([d["batch"] for d in decode], float)
    a = np.array([d["adapters"] for d in decode], float)
    y = np.array([max(d["step_s"], 1e-9) for d in decode], float)
    # One adapter count (or one batch) leaves the adapter (batch) terms indistinguishable from the
    # others: they stay 0 rather than take an arbitrary share.
    keep = np.array([True, len(set(b)) > 1, len(set(a)) > 1, len(set(b)) > 1 and len(set(a)) > 1])
    cols = np.stack([np.ones_like(b), b, a, b * a], axis=1)
    w = np.zeros(4)
    w[keep] = nonneg_rel_lstsq(cols[:, keep], y)
    fitted = cols @ w
    err = fitted / y - 1
    points = [{"batch": int(bb), "adapters": int(aa), "measured_s": float(yy), "fitted_s": float(f),
               "rel_err": float(e)} for bb, aa, yy, f, e in zip(b, a, y, fitted, err)]
    return {"model": "a + b*batch + c*adapters + d*batch*adapters (each >= 0)",
            "coef": {"a_s": float(w[0]), "b_s_per_seq": float(w[1]), "c_s_per_adapter": float(w[2]),
                     "d_s_per_seq_adapter": float(w[3])},
            "mean_abs_rel_err": float(np.mean(np.abs(err))), "points": points,
            "outliers": [p for p in points if abs(p["rel_err"]) > DECODE_OUTLIER]}


def fit_profile(raw: dict, base: dict, env: dict, decode_model: str = "surface") -> dict:
    """A profile: measured curves and fits from `raw`, the sharing section from `base`.
    ``decode_model``: "surface" puts the fitted surface (``fit_decode_surface``) at the measured
    batches into the curves, the measured points staying in ``measurements.calibrate.decode``;
    "points" interpolates the measured points themselves (every calibration before session 21)."""
    if decode_model not in DECODE_MODELS:
        raise ValueError(f"decode model {decode_model!r}: choose one of {', '.join(DECODE_MODELS)}")
    surface = fit_decode_surface(raw["decode"]) if decode_model == "surface" else None
    curves = []
    for a in sorted({d["adapters"] for d in raw["decode"]}):
        if surface:
            pts = sorted((p["batch"], p["fitted_s"]) for p in surface["points"] if p["adapters"] == a)
        else:
            pts = sorted((d["batch"], d["step_s"]) for d in raw["decode"] if d["adapters"] == a)
        curves.append({"adapters": a, "batch": [p[0] for p in pts], "step_s": [p[1] for p in pts]})
    pre = raw["prefill"]
    pa, pb = fit_linear_rel([p["tokens"] for p in pre], [max(p["s"], 1e-6) for p in pre])
    # Trainer: seconds = b * tokens + c * adapters, relative-error least squares.
    tr, step_mode, train_kl, dropped = train_points(raw)
    A = np.array([[t["tokens"] / t["s"], t["adapters"] / t["s"]] for t in tr])
    (tb, tc), *_ = np.linalg.lstsq(A, np.ones(len(tr)), rcond=None)
    tb, tc = max(float(tb), 1e-12), max(float(tc), 0.0)
    ctx = float(np.median([c["s_per_context_token"] for c in raw["context"]])) if raw["context"] else 0.0
    kept = [a for a in base.get("assumptions", []) if a["id"] in ("sharing-constant", "sharing-many-clients")]
    kept += [dropped] if dropped else []
    return {
        "schema": "nodus.profile/1",
        "environment": env,
        "decode": {"curves": curves, "s_per_context_token": ctx,
                   **({"graph_max_tokens": raw["graph_max_tokens"], "graphless": raw["graphless"]}
                      if raw.get("graph_max_tokens") and raw.get("graphless") else {})},
        "prefill": {"no_lora": {"a_s": pa, "b_s_per_unit": pb}, "lora": {"a_s": pa, "b_s_per_unit": pb}},
        "train": {"per_microbatch": {"a_s": 0.0, "b_s_per_unit": tb}, "s_per_adapter": tc,
                  "max_profiled_tokens": raw["train_mb_tokens"],
                  "step_mode": step_mode,
                  **({"kl_share": kl_share(train_kl, tb)} if train_kl else {})},
        "publish": {"save_s_per_adapter": float(np.median(raw["save_s"])),
                    "engine_load_s": float(np.median(raw["load_s"]))},
        "sharing": base["sharing"],
        "assumptions": kept + [{"id": "sharing-from-base", "value": None,
                                "what": "co-run and MPS rates are the base profile's, not measured in this calibration"},
                               {"id": "prefill-lora-any", "value": None,
                                "what": "prefill measured with LoRA adapters only; used for every adapter count"}]
                      + ([{"id": "decode-surface", "value": round(surface["mean_abs_rel_err"], 4),
                           "what": "decode curves are the fitted surface a + b*batch + c*adapters + d*batch*adapters "
                                   "at the measured batches (value: its mean relative error over the measured "
                                   "points, measurements.decode_fit; the points: measurements.calibrate.decode)"}]
                         if surface else []),
        "measurements": {"calibrate": raw, **({"decode_fit": surface} if surface else {})},
    }


def _fits_train(points: list[dict]) -> bool:
    """Whether `points` determine the train terms (a per-token and a per-adapter cost)."""
    return len(points) >= 2 and np.linalg.matrix_rank(np.array([[t["tokens"], t["adapters"]] for t in points],
                                                                dtype=float)) == 2


def train_points(raw: dict) -> tuple[list[dict], str, dict | None, dict | None]:
    """The train points a calibration's train terms are fitted on, the trainer step mode they
    describe, its KL point (None: not of that mode) and an assumption naming the points left out.

    A graph capture that fails mid-calibration (out of memory beside the engine on an 80 GB card,
    session 70) leaves the trainer eager for the points after it: fitting every point would mix two
    trainers. The points timed in the asked mode are kept where they determine the terms, else those
    of the mode it ended in; only where neither does are all kept, the mixture named."""
    trainer = raw.get("trainer") or {}
    final = trainer.get("step_mode", "eager")
    asked = trainer.get("step_mode_asked", final)
    tr = raw["train"]
    kl = raw.get("train_kl")
    if asked == final or not all("step_mode" in t for t in tr):
        return tr, final, kl, None
    for mode in (asked, final):
        points = [t for t in tr if t["step_mode"] == mode]
        if _fits_train(points):
            left = [t for t in tr if t["step_mode"] != mode]
            error = (trainer.get("graph_error") or "no error recorded").split(". ")[0]
            what = (f"the trainer was asked for {asked} steps and its graph capture failed mid-calibration "
                    f"({error}); the train terms are fitted on the "
                    f"{len(points)} point(s) timed {mode}, leaving out "
                    + ", ".join(f"{t['tokens']} tokens x {t['adapters']} adapters ({t['step_mode']})" for t in left)
                    + ("" if kl is None or kl.get("step_mode") == mode else "; the KL term, timed "
                       f"{kl.get('step_mode')}, is not priced"))
            return (points, mode, kl if kl is not None and kl.get("step_mode") == mode else None,
                    {"id": "train-mode-mixed", "value": len(left), "what": what})
    return tr, final, kl, {"id": "train-mode-mixed", "value": 0,
                           "what": f"the trainer was asked for {asked} steps and its graph capture failed "
                                   f"mid-calibration; too few points of one mode to fit, so the train terms mix "
                                   f"{asked} and {final} steps (step_mode {final})"}


def kl_share(kl: dict, b_s_per_token: float) -> float:
    """What the KL term (every job's beta > 0: the base model's forward for its reference
    logprobs) adds to a train step, as a share of the step's micro-batch cost (the fitted
    ``b_s_per_token`` x its tokens; the calibration's fit has no per-micro-batch constant): the
    step with the KL less the same step without (0 where the two time alike)."""
    return max(kl["s"] - kl["plain_s"], 0.0) / (kl["tokens"] * b_s_per_token)


CALIBRATE_SOURCE = "nodus calibrate"


def calibration_adapter_format(asked: str | None) -> str:
    """The adapter handoff a calibration times: ``asked``, else the runs' default
    (``RealOptions.adapter_format``): flat files where vLLM's engine core runs in this process
    (``real.engine.core_in_this_process``: nodus's default, as the runs' engine workers run it), PEFT
    folders where it does not (``VLLM_ENABLE_V1_MULTIPROCESSING=1``)."""
    from real.engine import core_in_this_process

    fmt = asked or ("flat" if core_in_this_process() else "safetensors")
    check_adapter_format(fmt)
    return fmt


def check_adapter_format(fmt: str) -> None:
    """Refuse, by name, a handoff nodus does not know or one this process's engine cannot load."""
    from real.engine import core_in_this_process
    from real.flat_adapter import ADAPTER_FORMATS

    if fmt not in ADAPTER_FORMATS:
        raise ValueError(f"--adapter-format {fmt!r}: choose one of {', '.join(ADAPTER_FORMATS)}")
    if fmt == "flat" and not core_in_this_process():
        raise ValueError("--adapter-format flat: the engine reads flat files only with vLLM's engine core in this "
                         "process (VLLM_ENABLE_V1_MULTIPROCESSING=0 in the environment); set it, or time PEFT "
                         "folders (--adapter-format safetensors)")


def calibrate(model: str | None, out: str | Path, base: str | None = None, batches=(8, 64, 256, 512),
              adapter_counts=(1, 8), prompt_tokens=(64, 256), lengths=(16, 64),
              train_tokens=None, device: str = "auto", dtype: str = "auto", enforce_eager: bool = False,
              repeats: int = 3, log=print, trainer_graphs: bool = False, tuned_lora_kernels: bool = True,
              engine_slots: int | None = None, decode_model: str = "surface",
              from_raw: str | Path | None = None, adapter_format: str | None = None) -> dict:
    """Measure and write a profile (``base``: the profile whose sharing section is kept, default
    h200-qwen3-0.6b). ``from_raw``: refit the measurements of a profile ``nodus calibrate`` wrote
    (``measurements.calibrate``; its environment and sharing section kept, the refit named in its
    sources) instead of measuring, e.g. with another ``decode_model``; a profile changed since
    (``nodus fit``, ``calibrate-sharing``) is refused, since a refit would drop those changes."""
    from sim.profile import profile_dict, refuse_existing, write_profile

    refuse_existing(out, "calibrate")
    if decode_model not in DECODE_MODELS:
        raise ValueError(f"--decode-model {decode_model!r}: choose one of {', '.join(DECODE_MODELS)}")
    if from_raw is not None:
        given = [flag for flag, v in (("--model", model), ("--base", base), ("--engine-slots", engine_slots),
                                      ("--adapter-format", adapter_format)) if v is not None]
        if given:
            raise ValueError(f"--from-raw refits measurements already taken: {', '.join(given)} would not be used "
                             "(the profile's own sharing section and engine are kept)")
        prof = _log_decode_fit(refit_calibration(from_raw, decode_model), log)
        write_profile(prof, out, "calibrate")
        return prof
    if model is None:
        raise ValueError("nodus calibrate: --model (a local model folder to measure) or --from-raw PROFILE")
    base = base or "h200-qwen3-0.6b"
    adapter_format = calibration_adapter_format(adapter_format)  # before anything loads
    if engine_slots is not None and engine_slots < max(adapter_counts):
        raise ValueError(f"--engine-slots {engine_slots}: fewer than the {max(adapter_counts)} adapters a point "
                         f"measures (--adapters); give at least {max(adapter_counts)}")
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dtype = ("bfloat16" if device == "cuda" else "float32") if dtype == "auto" else dtype
    base_prof = profile_dict(base)
    # The GPU's memory before anything of this calibration starts: the simulator fits a default
    # trainer micro-batch to it (nodus.gpumemory.profile_gpu_memory). None off a GPU.
    from nodus.gpumemory import gpu_memory_gib

    memory = gpu_memory_gib() if device.startswith("cuda") else None
    train_tokens = calibration_train_tokens(train_tokens, memory, trainer_graphs and device.startswith("cuda"), log)
    raw = measure(model, list(batches), list(adapter_counts), tuple(prompt_tokens), tuple(lengths),
                  list(train_tokens), device, dtype, enforce_eager=enforce_eager, repeats=repeats, log=log,
                  trainer_graphs=trainer_graphs, tuned_lora_kernels=tuned_lora_kernels, engine_slots=engine_slots,
                  adapter_format=adapter_format)
    # The handoff the publish terms (and the train terms' save) describe (sim.profile.profile_adapter_format).
    env = {**environment(device), "adapter_format": adapter_format,
           "model": os.path.basename(os.path.normpath(model)), "sources": [CALIBRATE_SOURCE],
           "lora_kernel_configs": raw.get("lora_kernel_configs"), "engine_max_loras": raw["engine_max_loras"],
           "gpu_memory_gib": None if memory is None else [round(memory[0], 2), round(memory[1], 2)]}
    prof = _log_decode_fit(fit_profile(raw, base_prof, env, decode_model), log)
    write_profile(prof, out, "calibrate")
    return prof


def refit_calibration(path: str | Path, decode_model: str) -> dict:
    """A profile from the measurements of the one ``nodus calibrate`` wrote at ``path`` (or a refit of
    it): its environment and sharing section kept, the refit added to its sources."""
    import json

    old = json.loads(Path(path).read_text())
    raw = (old.get("measurements") or {}).get("calibrate")
    if not raw or not raw.get("decode") or not isinstance(old.get("environment"), dict) or "sharing" not in old:
        raise ValueError(f"--from-raw {path}: not a profile nodus calibrate wrote (its measurements.calibrate, "
                         "environment and sharing sections)")
    sources = old["environment"].get("sources") or []
    other = [src for src in sources if not src.startswith(CALIBRATE_SOURCE) or src.startswith("nodus calibrate-")]
    if other:
        raise ValueError(f"--from-raw {path}: changed since its calibration ({'; '.join(other)}); a refit of its "
                         "measurements would drop that: refit the file nodus calibrate wrote")
    env = {**old["environment"],
           "sources": sources + [f"{CALIBRATE_SOURCE} --from-raw {Path(path).name} (decode model {decode_model})"]}
    return fit_profile(raw, old, env, decode_model)


def _log_decode_fit(prof: dict, log) -> dict:
    fit = (prof.get("measurements") or {}).get("decode_fit")
    if fit:
        log(f"decode surface: {fit['model']}, mean error {fit['mean_abs_rel_err']:.1%} over "
            f"{len(fit['points'])} points")
        for p in fit["outliers"]:
            log(f"  decode point off the surface by {p['rel_err']:+.0%}: batch {p['batch']}, {p['adapters']} "
                f"adapter(s), measured {p['measured_s'] * 1e3:.2f} ms, surface {p['fitted_s'] * 1e3:.2f} ms")
    return prof
