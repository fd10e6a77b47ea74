"""Two stacks' engines generating at once, measured by engine size: `nodus calibrate-engines`.

The simulator prices each engine of two stacks generating together at one rate
(``sharing.mps_engines``), which `nodus fit-stacks` fits on recorded runs of 2 and 4 jobs: engines
of 64-128 sequences. On the H200 that rate held for engines of 256 sequences (8 jobs) and not for
engines of 512 (16 jobs): fitted on each size's own runs, 0.83 (64), 0.87 (128), 0.86 (256), 0.71
(512), so the protocol profile priced 16 jobs' generations 12-17% short (session 58). The runs of at
most 4 jobs that #5's protocol fits on never reach 512 sequences; this bench does, without a
held-out run: two engine processes of a two-stack cluster (the backend's own, under its sharing
mode's daemon), each generating ``batch`` sequences of forced length over ``batch / 64`` adapters
(a job's 64 sequences each, as the runs' engines hold them), timed

- alone: one engine generating, the other idle;
- beside the other: one engine generating while the other generates the same batch back to back;
- beside the other stack's trainer: one engine generating while the other stack's trainer steps back
  to back over as many sequences of as many adapters (prompt plus response tokens each, saves
  included), as a stack's trainer steps beside the other's generation in a run of that many jobs;
  and that trainer's step, alone and while the engine generates back to back.

A bucket's slowdown is beside over alone (each engine in turn in the foreground, the median). The
profile keeps them as ``sharing.engines_by_batch`` (per sharing mode measured: ``mps`` beside the
other engine, ``mps_beside_trainer`` beside the other stack's trainer, ``mps_trainer_beside`` that
trainer's step beside the engine); the simulator takes the two-engine rate's shape over engine size
from the first (sim.gpu.engines_rate), and under MPS the rates of an engine and the other stack's
lone trainer beside each other from the others (sim.gpu.stacks_engine_rate, stacks_trainer_rate). On the
H200, the protocol profile priced 16 jobs' generations 5% short where the other engine generated
throughout and 14% short where it partly trained (session 58): both rates were fitted at 128
sequences.

Raw timings go beside the profile (``x.json``: ``x.raw.json``) after every bucket, so a device call's
time limit keeps what it measured; ``--from-raw FILE`` builds the profile from such a file without
measuring (``--batches`` then picks the engine sizes to take).

What the bench guards (session 61, two H100 runs): a bucket's kinds of timing are interleaved, since
an engine's alone times fell through a bucket timed kind by kind while its beside times held to 1%;
a batch past one engine's KV cache is refused before any engine starts (vLLM would queue the rest and
time two waves); the raw file records the GPU, and a bench run under other settings than the base's
(GPU, CUDA-graph size, LoRA kernels, trainer mode, stacks controls) is refused by name unless
``--transplant`` makes it a what-if the profile names.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from calibration.corun import DONE, fresh_raw_path, interleaved, write_raw
from calibration.measure import _requests, _train_batches
from nodus.gpumemory import query_gpu

BATCHES = (64, 128, 256, 512)  # engine sizes: 1, 2, 4 and 8 jobs of 64 sequences
SEQS_PER_ADAPTER = 64  # a job's sequences a step (8 prompts x 8 responses), one adapter each
MODES = ("none", "mps")
BESIDE = ("engine", "trainer")  # what runs beside the timed engine: the other engine, the other stack's trainer


def adapters_for(batch: int, seqs_per_adapter: int = SEQS_PER_ADAPTER) -> int:
    """The adapters an engine of ``batch`` sequences holds: one per job of ``seqs_per_adapter``."""
    return max(1, -(-batch // seqs_per_adapter))


class _Engines:
    """The engines of a two-stack Cluster, each with its own calibration adapters (its trainer makes
    them and publishes them to it, as in a run); the trainers stay idle afterwards."""

    def __init__(self, model: str, sharing: str, device: str, max_batch: int, adapters: int,
                 engine_memory: float, enforce_eager: bool, rank: int = 16, tuned_lora_kernels: bool = True,
                 cuda_graph_max_tokens: int | None = None, trainer_graphs: bool = False, controls: dict | None = None,
                 microbatch_tokens: int = 8192):
        from real.backend import Cluster, RealOptions
        from real.trainer import JobConfig

        c = controls or {}
        opts = RealOptions(model=model, mode="synthetic", device=device, engine_memory=engine_memory,
                           enforce_eager=enforce_eager, warmup=False, tuned_lora_kernels=tuned_lora_kernels,
                           trainer_graphs=trainer_graphs, trainer_priority=c.get("trainer_priority") or "normal",
                           engine_cpu_threads=c.get("engine_cpu_threads"),
                           trainer_cpu_threads=c.get("trainer_cpu_threads"))
        self.c = Cluster(opts, sharing, 2, max_loras=adapters, max_rank=rank, max_num_seqs=max_batch,
                         max_tokens_per_microbatch=microbatch_tokens, cuda_graph_max_tokens=cuda_graph_max_tokens)
        self.vocab = self.c.vocab_size
        self.dir = Path(tempfile.mkdtemp(prefix="nodus-engines-"))
        self._n = 0
        jobs = [f"cal{a}" for a in range(adapters)]
        for s in range(2):
            for a, job in enumerate(jobs):
                self.c.trainers[s].put(("add", self._tag(), job,
                                        JobConfig(rank=rank, alpha=2 * rank, lr=1e-6, seed=a),
                                        str(self.dir / f"s{s}" / job / "v{v}")))
                self._wait("added")
            self.c.engines[s].put(("publish", self._tag(), [(j, 0, str(self.dir / f"s{s}" / j / "v0")) for j in jobs]))
            self._wait("published")
        self.rng = np.random.default_rng(0)

    def _tag(self) -> str:
        self._n += 1
        return f"e{self._n}"

    def _wait(self, kind: str, tag: str | None = None):
        while True:
            msg = self.c.get(timeout=1800)
            if msg[0] == kind and (tag is None or msg[1] == tag):
                return msg

    def gen_request(self, batch: int, prompt: int, length: int, seqs_per_adapter: int = SEQS_PER_ADAPTER):
        return _requests(adapters_for(batch, seqs_per_adapter), batch, prompt, length, self.vocab, self.rng)

    def train_request(self, batch: int, prompt: int, length: int, seqs_per_adapter: int = SEQS_PER_ADAPTER):
        """A trainer step over ``batch`` sequences of ``prompt + length`` tokens, one adapter per
        ``seqs_per_adapter`` of them (the jobs an engine of ``batch`` sequences generates for)."""
        n = adapters_for(batch, seqs_per_adapter)
        seq = prompt + length
        batches = _train_batches(n, batch * seq, self.vocab, self.rng, seq=seq)
        return batches, {j: str(self.dir / "scratch" / j) for j in batches}

    def _put(self, side: str, stack: int, work) -> str:
        """Hand ``stack``'s engine a generation or its trainer a step (``side``: "engine" or
        "trainer", corun.SIDES); the task's tag."""
        tag = self._tag()
        if side == "engine":
            self.c.engines[stack].put(("gen", tag, work))
        else:
            self.c.trainers[stack].put(("train", tag, work[0], work[1], None, None))
        return tag

    def _time(self, fg: tuple[str, int, object], bg: tuple[str, int, object] | None = None) -> float:
        """Seconds of one task ``fg`` (side, stack, work), alone or while ``bg`` (another stack's side)
        runs back to back: started first, handed again as each of its tasks ends, its last one
        drained afterwards."""
        if bg is not None:
            bg_tag = self._put(*bg)
            time.sleep(0.05)  # the background is running before the timed task starts
        t0 = time.monotonic()
        fg_tag = self._put(*fg)
        end = None
        while end is None:
            msg = self.c.get(timeout=1800)
            if msg[0] == DONE[fg[0]] and msg[1] == fg_tag:
                end = time.monotonic()
            elif bg is not None and msg[0] == DONE[bg[0]] and msg[1] == bg_tag:
                bg_tag = self._put(*bg)
        if bg is not None:
            self._wait(DONE[bg[0]], bg_tag)
        return end - t0

    def alone(self, engine: int, work) -> float:
        return self._time(("engine", engine, work))

    def train_alone(self, stack: int, train) -> float:
        return self._time(("trainer", stack, train))

    def beside(self, engine: int, work) -> float:
        """Seconds of one generation of ``engine`` while the other engine generates ``work`` back to back."""
        return self._time(("engine", engine, work), ("engine", 1 - engine, work))

    def beside_trainer(self, engine: int, work, train) -> float:
        """Seconds of one generation of ``engine`` while the other stack's trainer steps ``train`` back
        to back."""
        return self._time(("engine", engine, work), ("trainer", 1 - engine, train))

    def trainer_beside(self, stack: int, train, work) -> float:
        """Seconds of one step of ``stack``'s trainer while the other stack's engine generates ``work``
        back to back."""
        return self._time(("trainer", stack, train), ("engine", 1 - stack, work))

    def close(self) -> None:
        self.c.close()


def bucket_line(mode: str, row: dict) -> str:
    parts = [f"{mode} batch {row['batch']} ({row['adapters']} adapters): alone {row['alone_s']:.3f} s"]
    if "beside_s" in row:
        parts.append(f"beside the other engine {row['beside_s']:.3f} s, slowdown {row['slowdown']:.3f}")
    if "beside_trainer_s" in row:
        parts.append(f"beside the other stack's trainer {row['beside_trainer_s']:.3f} s, slowdown "
                     f"{row['trainer_slowdown']:.3f}")
    if "train_beside_s" in row:
        parts.append(f"that trainer's step alone {row['train_alone_s']:.3f} s, beside this engine "
                     f"{row['train_beside_s']:.3f} s, slowdown {row['train_slowdown']:.3f}")
    return ", ".join(parts)


KINDS = ("alone", "beside", "beside_trainer", "train_alone", "train_beside")  # a row's timings


def _row(batch: int, adapters: int, alone: list[float], beside: list[float] | None = None,
         beside_trainer: list[float] | None = None, train_alone: list[float] | None = None,
         train_beside: list[float] | None = None) -> dict:
    """A bucket's row: medians of each kind of timing (every timing kept), slowdowns over alone (the
    engine's over its generation alone, the trainer's over its step alone)."""
    a = float(np.median(alone))
    row = {"batch": batch, "adapters": adapters, "alone_s": a, "alone_each_s": alone}
    if beside:
        row.update(beside_s=float(np.median(beside)), beside_each_s=beside)
        row["slowdown"] = row["beside_s"] / a
    if beside_trainer:
        row.update(beside_trainer_s=float(np.median(beside_trainer)), beside_trainer_each_s=beside_trainer)
        row["trainer_slowdown"] = row["beside_trainer_s"] / a
    if train_alone:
        row.update(train_alone_s=float(np.median(train_alone)), train_alone_each_s=train_alone)
        if train_beside:
            row.update(train_beside_s=float(np.median(train_beside)), train_beside_each_s=train_beside)
            row["train_slowdown"] = row["train_beside_s"] / row["train_alone_s"]
    return row


# What a vLLM engine holds of its memory share besides its KV cache, beyond the weights: peak
# activations, non-torch memory and rounding (H100, session 61: 15.04 GiB share, 1.38 GiB weights,
# 13.0 GiB of KV cache).
ENGINE_KV_MARGIN_GIB = 0.7


def kv_bytes_per_token(model: str | Path) -> int | None:
    """KV-cache bytes a token of ``model`` (a local folder's config.json): keys and values of every
    layer's KV heads, at the weights' dtype; None where the folder has no such config."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        width = 4 if str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16") == "float32" else 2
        return 2 * int(cfg["num_hidden_layers"]) * int(kv_heads) * int(head_dim) * width
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _held_gib(model: str | Path) -> float:
    """What an engine holds of its share besides the KV cache: the weights (the folder's safetensors)
    and ENGINE_KV_MARGIN_GIB."""
    return sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 2**30 + ENGINE_KV_MARGIN_GIB


def kv_room_tokens(model: str | Path, engine_memory: float, total_gib: float) -> int | None:
    """About how many tokens one engine's KV cache holds: its half of ``engine_memory`` of a GPU of
    ``total_gib``, less ``_held_gib``, over ``kv_bytes_per_token``; None where the model's shape is
    unknown."""
    per_token = kv_bytes_per_token(model)
    if per_token is None:
        return None
    return max(0, int((engine_memory / 2 * total_gib - _held_gib(model)) * 2**30 / per_token))


def check_kv_room(model: str | Path, batches, prompt: int, length: int, engine_memory: float,
                  total_gib: float | None) -> None:
    """Refuse a bench whose largest batch does not fit one engine's KV cache: vLLM would queue the
    sequences past it and time two waves, not one batch (session 61: 512 sequences of 384 tokens
    beside 121,744 tokens of KV cache on an H100 at --engine-memory 0.38)."""
    from nodus.config import ConfigError

    if total_gib is None:
        return
    room = kv_room_tokens(model, engine_memory, total_gib)
    need = max(batches) * (prompt + length)
    if room is None or need <= room:
        return
    fits = 2 * (need * kv_bytes_per_token(model) / 2**30 + _held_gib(model)) / total_gib
    raise ConfigError(f"calibrate-engines: {max(batches)} sequences of {prompt} + {length} tokens need {need:,} "
                      f"tokens of KV cache an engine; --engine-memory {engine_memory} of this {total_gib:.0f} GiB GPU "
                      f"leaves each of the two engines about {room:,}, so vLLM would queue the rest and time two "
                      f"waves: raise --engine-memory to {fits:.2f} or more, or leave that batch out of --batches")


def measure_engines(model: str, modes=("mps",), batches=BATCHES, prompt: int = 128, length: int = 256,
                    repeats: int = 2, device: str = "auto", engine_memory: float = 0.35, enforce_eager: bool = False,
                    seqs_per_adapter: int = SEQS_PER_ADAPTER, cuda_graph_max_tokens: int | None = None,
                    tuned_lora_kernels: bool = True, trainer_graphs: bool = False, beside=BESIDE,
                    controls: dict | None = None, microbatch_tokens: int = 8192,
                    raw_path: str | Path | None = None, log=print,
                    make_engines=_Engines) -> tuple[dict, dict]:
    """Raw rows per mode (each: batch, adapters, alone seconds; beside the other engine and beside
    the other stack's trainer, as ``beside`` names, with their slowdowns) and the settings. Each
    engine is the foreground ``repeats`` times per bucket and kind (2 x repeats timings of each), the
    kinds interleaved (engine 0 alone, beside, ..., then engine 1's in reverse order, then the next
    repeat), so a drift through a bucket falls on every kind alike; every shape is generated (and trained) once first,
    untimed (graphs, kernels, allocator).
    ``controls``: the runs' settings the processes take (``trainer_priority``, ``engine_cpu_threads``,
    ``trainer_cpu_threads``; the stacks fit's, as ``stacks_controls`` reads them off a profile).
    ``make_engines`` builds each mode's engines (tests pass a timed stand-in)."""
    batches = sorted(set(batches))
    beside = tuple(beside)
    gpu = query_gpu("name,memory.total") if device != "cpu" else None  # None: no GPU nvidia-smi can tell of
    settings = {"gpu": gpu[0] if gpu else None, "modes": list(modes), "batches": batches, "prompt": prompt, "length": length,
                "repeats": repeats, "engine_memory": engine_memory, "seqs_per_adapter": seqs_per_adapter,
                "cuda_graph_max_tokens": cuda_graph_max_tokens, "tuned_lora_kernels": tuned_lora_kernels,
                "beside": list(beside)}
    if "trainer" in beside:
        settings.update(trainer_graphs=trainer_graphs, microbatch_tokens=microbatch_tokens)
    settings["controls"] = dict(controls or {})
    if make_engines is _Engines:
        check_kv_room(model, batches, prompt, length, engine_memory, float(gpu[1]) / 1024 if gpu else None)
    raw: dict = {}
    for mode in modes:
        eng = make_engines(model, mode, device, max(batches), adapters_for(max(batches), seqs_per_adapter),
                           engine_memory, enforce_eager, tuned_lora_kernels=tuned_lora_kernels,
                           cuda_graph_max_tokens=cuda_graph_max_tokens, trainer_graphs=trainer_graphs,
                           controls=controls, microbatch_tokens=microbatch_tokens)
        try:
            work = {b: eng.gen_request(b, prompt, length, seqs_per_adapter) for b in batches}
            train = ({b: eng.train_request(b, prompt, length, seqs_per_adapter) for b in batches}
                     if "trainer" in beside else {})
            for w in work.values():  # warm-up, both engines, untimed
                eng.alone(0, w)
                eng.alone(1, w)
            for t in train.values():  # and both trainers
                eng.train_alone(0, t)
                eng.train_alone(1, t)
            rows = raw[mode] = []
            for b in batches:
                # Each kind's timings interleaved, one of each per engine in turn: an engine's alone times
                # fell through a bucket timed kind by kind (H100, sessions 60-61: 1.675, 1.642, 1.605,
                # 1.588 s then beside 2.55 s to 1%), so a slowdown over the first ones came out low.
                # Every other pass in reverse (ABBA), so a steady drift cancels between kinds.
                def kinds(e: int) -> list:  # engine e in front, one timing of each kind
                    out = [("alone", lambda: eng.alone(e, work[b]))]
                    if "engine" in beside:
                        out.append(("beside", lambda: eng.beside(e, work[b])))
                    if "trainer" in beside:
                        out += [("train_alone", lambda: eng.train_alone(e, train[b])),
                                ("beside_trainer", lambda: eng.beside_trainer(e, work[b], train[b])),
                                ("train_beside", lambda: eng.trainer_beside(e, train[b], work[b]))]
                    return out

                t = interleaved(kinds(e) for _ in range(repeats) for e in (0, 1))
                rows.append(_row(b, adapters_for(b, seqs_per_adapter), *(t.get(k) for k in KINDS)))
                if raw_path is not None:
                    write_raw(raw_path, raw, settings)
                log(bucket_line(mode, rows[-1]))
        finally:
            eng.close()
    return raw, settings


def stacks_controls(prof: dict) -> dict:
    """The settings the profile's stacks rates were fitted under (``sharing.stacks_trainer_controls``,
    else ``sharing.engines_controls``) that the bench's processes take: the trainer's MPS priority and
    both sides' CPU threads, so its slowdowns are the fitted runs' (their trainers ran below normal
    priority on 2 threads, the engines on 4)."""
    sh = prof.get("sharing") or {}
    got = sh.get("stacks_trainer_controls") or sh.get("engines_controls") or {}
    out = {"trainer_priority": got.get("mps.trainer_priority"), "engine_cpu_threads": got.get("engine_cpu_threads"),
           "trainer_cpu_threads": got.get("trainer_cpu_threads")}
    return {k: v for k, v in out.items() if v is not None}


def base_settings(prof: dict) -> dict:
    """What a bench on ``prof`` as its base runs under: the base's GPU, CUDA-graph size, LoRA kernels,
    trainer mode and stacks controls (calibrate_engines measures with these)."""
    from sim.profile import profile_lora_kernels, profile_step_mode

    return {"gpu": (prof.get("environment") or {}).get("gpu"),
            "cuda_graph_max_tokens": (prof.get("decode") or {}).get("graph_max_tokens"),
            "tuned_lora_kernels": profile_lora_kernels(prof) == "tuned",
            "trainer_graphs": profile_step_mode(prof) != "eager", "controls": stacks_controls(prof)}


def bench_differences(got: dict, prof: dict) -> list[str]:
    """How a bench's recorded settings ``got`` differ from what a bench on base ``prof`` runs under,
    one phrase each; a setting the bench did not record is not compared (runs before session 61 have
    no ``gpu``), nor the trainer's mode where it timed no trainer."""
    want = base_settings(prof)
    out = []
    for k, v in want.items():
        if k not in got or (k == "gpu" and (got[k] is None or v is None)):
            continue
        if k == "trainer_graphs" and (got[k] is None or "trainer" not in got.get("beside", BESIDE)):
            continue
        if (got[k] or None) != (v or None):
            out.append(f"{k} {got[k]!r} against the base's {v!r}")
    return out


def read_raw(path: str | Path) -> tuple[dict, dict]:
    """A raw-timings file's rows and settings, checked: a named error for what is not one."""
    from nodus.config import ConfigError

    try:
        data = json.loads(Path(path).read_text())
        raw, settings = data["raw"], data["settings"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"calibrate-engines --from-raw {str(path)!r}: not a raw-timings file of "
                          f"calibrate-engines ({e.__class__.__name__}: {e})") from None
    for mode, rows in raw.items():
        if mode not in MODES:
            raise ConfigError(f"calibrate-engines --from-raw {str(path)!r}: mode {mode!r} is not one of {MODES}")
        for r in rows:
            if not all(_positive(r.get(k)) for k in ("batch", "alone_s")) or not any(
                    _positive(r.get(k)) for k in ("beside_s", "beside_trainer_s")):
                raise ConfigError(f"calibrate-engines --from-raw {str(path)!r}: {mode} row {r!r} lacks a positive "
                                  "batch, alone_s or beside_s (or beside_trainer_s)")
            bad = [k for k in ("beside_s", "beside_trainer_s", "train_alone_s", "train_beside_s")
                   if k in r and not _positive(r[k])]
            if "train_beside_s" in r and "train_alone_s" not in r:
                bad = ["train_alone_s"]
            if bad:
                raise ConfigError(f"calibrate-engines --from-raw {str(path)!r}: {mode} row {r!r}: {bad[0]} is not "
                                  "a positive number of seconds")
    return raw, settings


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


POOLED_SETTINGS = ("prompt", "length", "seqs_per_adapter", "cuda_graph_max_tokens", "tuned_lora_kernels", "controls")
TRAINER_POOLED = ("trainer_graphs", "microbatch_tokens")  # equal where both runs timed the trainer


def pool_raw(files: list[str | Path]) -> tuple[dict, dict]:
    """Several bench runs' raw timings as one: each (mode, batch) bucket's timings of every run
    together, its medians over all of them (one run's alone times at 512 sequences on the H100 moved
    15% between two runs while the beside times held to 1%). Runs of other prompt or response lengths,
    adapters per sequence, graphs or kernels are refused by name. A slowdown is over the alone times
    of the runs that timed its kind beside (a run of the trainer kind only does not move the
    two-engine slowdown through its alone times): ``slowdown_alone_s`` and
    ``trainer_slowdown_alone_s`` where they differ from the bucket's ``alone_s``."""
    from nodus.config import ConfigError

    pooled: dict[str, dict[int, dict]] = {}
    settings = None
    for f in files:
        raw, got = read_raw(f)
        if settings is None:
            settings = dict(got, runs=[str(f) for f in files])
        differ = [k for k in POOLED_SETTINGS if (got.get(k) or None) != (settings.get(k) or None)]
        if got.get("gpu") and settings.get("gpu") and got["gpu"] != settings["gpu"]:
            differ.append("gpu")  # a run that did not record its GPU (before session 61) pools with any
        settings["gpu"] = settings.get("gpu") or got.get("gpu")
        for k in TRAINER_POOLED:  # a run without trainer rows has none to pool
            if got.get(k) is not None:
                if settings.get(k) is None:
                    settings[k] = got[k]
                elif got[k] != settings[k]:
                    differ.append(k)
        if differ:
            raise ConfigError(f"calibrate-engines --from-raw: {str(f)!r} ran other settings than {str(files[0])!r} "
                              f"({', '.join(f'{k} {got.get(k)!r} against {settings.get(k)!r}' for k in differ)}): "
                              "pool runs of one bench only")
        for mode, rows in raw.items():
            for r in rows:
                b = pooled.setdefault(mode, {}).setdefault(int(r["batch"]), {
                    "adapters": r.get("adapters"), **{k: [] for k in KINDS}, "alone_beside": [],
                    "alone_beside_trainer": []})
                for kind in KINDS:
                    if f"{kind}_s" in r:
                        b[kind] += r.get(f"{kind}_each_s") or [r[f"{kind}_s"]]
                alone = r.get("alone_each_s") or [r["alone_s"]]
                for kind in ("beside", "beside_trainer"):
                    if f"{kind}_s" in r:
                        b[f"alone_{kind}"] += alone
    raw = {}
    for mode, by in pooled.items():
        raw[mode] = []
        for batch, b in sorted(by.items()):
            row = _row(batch, b["adapters"], *(b[k] for k in KINDS))
            for kind, key in (("beside", "slowdown"), ("beside_trainer", "trainer_slowdown")):
                if key in row and b[f"alone_{kind}"] != b["alone"]:
                    a = float(np.median(b[f"alone_{kind}"]))
                    row[f"{key}_alone_s"] = a
                    row[key] = row[f"{kind}_s"] / a
            raw[mode].append(row)
    settings["modes"] = sorted(raw)
    settings["batches"] = sorted({int(r["batch"]) for rows in raw.values() for r in rows})
    settings["beside"] = [k for k, f in (("engine", "beside_s"), ("trainer", "beside_trainer_s"))
                          if any(f in r for rows in raw.values() for r in rows)]
    return raw, settings


def engines_by_batch(raw: dict) -> list[dict]:
    """``sharing.engines_by_batch``: per batch and mode, the engine's slowdown beside the other engine
    (``<mode>``) and beside the other stack's trainer (``<mode>_beside_trainer``), and that trainer's
    step's slowdown beside the engine (``<mode>_trainer_beside``), each over its time alone."""
    by: dict[int, dict] = {}
    for mode, rows in raw.items():
        for r in rows:
            e = by.setdefault(int(r["batch"]), {"batch": int(r["batch"])})
            if "beside_s" in r:
                e[mode] = r["beside_s"] / r.get("slowdown_alone_s", r["alone_s"])
            if "beside_trainer_s" in r:
                e[f"{mode}_beside_trainer"] = r["beside_trainer_s"] / r.get("trainer_slowdown_alone_s", r["alone_s"])
            if "train_beside_s" in r:
                e[f"{mode}_trainer_beside"] = r["train_beside_s"] / r["train_alone_s"]
    return [by[b] for b in sorted(by)]


def apply_engines(prof: dict, raw: dict, settings: dict, source: dict | None = None) -> dict:
    """Put the bench's slowdowns into a profile dict (``sharing.engines_by_batch``), its rows and
    settings under ``measurements.engines``, and the assumption the simulator makes with them."""
    missing = [{"mode": m, "batch": b} for m in settings.get("modes", raw) for b in settings.get("batches", [])
               if b not in {int(r["batch"]) for r in raw.get(m, [])}]
    prof.setdefault("sharing", {})["engines_by_batch"] = engines_by_batch(raw)
    prof.setdefault("measurements", {})["engines"] = {"settings": settings, "rows": raw, "missing": missing,
                                                      **({"source": source} if source else {})}
    prof["assumptions"] = [a for a in prof.get("assumptions", []) if a.get("id") not in (
        "sharing-engines-by-batch", "sharing-engine-beside-trainer-by-batch")]
    bench = prof["sharing"]["engines_by_batch"]
    if any(m in e for e in bench for m in MODES):
        prof["assumptions"].append({
            "id": "sharing-engines-by-batch",
            "what": ("two engines' rate by engine size from the two-engine bench (nodus calibrate-engines: "
                     "forced-length generations, one adapter per 64 sequences); where the profile has a fitted "
                     "two-engine rate (sharing.mps_engines) it keeps that rate at the fit runs' engine size "
                     "(sharing.stacks_engine_sequences) and takes the bench's ratio elsewhere"),
            "value": ", ".join(f"{e['batch']}: " + "/".join(f"{m} {e[m]:.3f}" for m in MODES if m in e)
                               for e in bench if any(m in e for m in MODES))})
    if any(f"{m}_beside_trainer" in e for e in bench for m in MODES):
        prof["assumptions"].append({
            "id": "sharing-engine-beside-trainer-by-batch",
            "what": ("an engine's rate beside the other stack's lone trainer, and that trainer's beside it, by engine "
                     "size from the same bench (the trainer stepping over as many sequences and adapters as the engine "
                     "generates); under MPS, where the profile has fitted rates (sharing.mps_stacks_engine, "
                     "mps_stacks_trainer) it keeps them at the fit runs' engine size and takes the bench's ratio "
                     "elsewhere; time-sliced stacks keep the pair's rates"),
            "value": ", ".join(f"{e['batch']}: " + "/".join(
                f"{m} engine {e[m + '_beside_trainer']:.3f}" + (f", trainer {e[m + '_trainer_beside']:.3f}"
                                                                if f"{m}_trainer_beside" in e else "")
                for m in MODES if f"{m}_beside_trainer" in e)
                for e in bench if any(f"{m}_beside_trainer" in e for m in MODES))})
    return prof


def calibrate_engines(model: str | None, base: str, out: str | Path, modes=("mps",),
                      from_raw: str | Path | list | None = None, transplant: bool = False,
                      only_batches=None, log=print, **settings) -> dict:
    """`nodus calibrate-engines`: measure (raw timings beside ``out`` as they come) or read
    ``from_raw`` (one raw-timings file, or several: pooled), then write the base profile with
    ``sharing.engines_by_batch``. A bench run under other settings than the base's (another GPU,
    CUDA-graph size, LoRA kernels, trainer mode or stacks controls: ``bench_differences``) is refused
    by name, unless ``transplant``: a what-if whose profile names each difference in an assumption.
    ``only_batches``: the engine sizes to take of the raw timings (each must be there)."""
    from nodus.config import ConfigError
    from sim.profile import add_source, drop_base_validation, profile_dict, refuse_existing, write_profile

    refuse_existing(out, "calibrate-engines")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"--modes {','.join(modes)!r}: choose from {','.join(MODES)}")
    beside = settings.get("beside", BESIDE)
    if not beside or any(b not in BESIDE for b in beside):
        raise ConfigError(f"--beside {','.join(beside)!r}: choose one or more of {','.join(BESIDE)}")
    prof = profile_dict(base)
    if from_raw is not None:
        files = [from_raw] if isinstance(from_raw, (str, Path)) else list(from_raw)
        raw, got = read_raw(files[0]) if len(files) == 1 else pool_raw(files)
        if only_batches:
            have = {int(r["batch"]) for rows in raw.values() for r in rows}
            if set(only_batches) - have:
                raise ConfigError(f"calibrate-engines --batches {','.join(map(str, only_batches))}: the raw timings "
                                  f"have no bucket of {', '.join(map(str, sorted(set(only_batches) - have)))} "
                                  f"sequences (they have {', '.join(map(str, sorted(have)))})")
            raw = {m: [r for r in rows if int(r["batch"]) in only_batches] for m, rows in raw.items()}
            got = dict(got, batches=sorted(set(only_batches)))
        differ = bench_differences(got, prof)
        if differ and not transplant:
            raise ConfigError(f"calibrate-engines --from-raw: the bench ran under other settings than the base "
                              f"{base!r} ({'; '.join(differ)}): its slowdowns are not the base's; bench on the "
                              "base's settings, or pass --transplant for a what-if that names the difference")
        apply_engines(prof, raw, got, source={"files": [str(f) for f in files]})
        if differ:
            prof["assumptions"].append({
                "id": "sharing-engines-bench-transplanted",
                "what": ("the engine bench (sharing.engines_by_batch) ran under other settings than this profile's "
                         "other terms (nodus calibrate-engines --transplant): a what-if, not a measurement of them"),
                "value": "; ".join(differ)})
        add_source(prof, f"nodus calibrate-engines --from-raw {' '.join(Path(f).name for f in files)} "
                         f"({','.join(raw)})")
    else:
        if not model:
            raise ConfigError("calibrate-engines: --model is required to measure (or --from-raw FILE builds the "
                              "profile from a run's raw timings, without measuring)")
        raw_path = fresh_raw_path(out, "calibrate-engines", log)
        on = base_settings(prof)
        raw, got = measure_engines(model, modes=modes, raw_path=raw_path, log=log,
                                   cuda_graph_max_tokens=on["cuda_graph_max_tokens"],
                                   tuned_lora_kernels=on["tuned_lora_kernels"], trainer_graphs=on["trainer_graphs"],
                                   controls=on["controls"], **settings)
        apply_engines(prof, raw, got)
        add_source(prof, f"nodus calibrate-engines ({','.join(modes)})")
    drop_base_validation(prof)  # it measured the base: none until nodus validate --annotate
    write_profile(prof, out, "calibrate-engines")
    return prof
