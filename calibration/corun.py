"""Engine and trainer sharing one GPU, measured the way the real backend runs them: two processes.

For each sharing mode (`none`: the driver time-slices them; `mps`: the backend's own MPS daemon)
and each bucket (engine batch, trainer tokens), three timings:

- the engine alone: one generation of `batch` sequences (prompt and forced response lengths);
- the trainer alone: one step of `tokens` tokens over 8 adapters (saves included, as in a run);
- each side while the other is kept busy: the trainer steps back to back while the engine
  generates once, and the engine generates back to back while the trainer steps once.

Each timing is repeated (`repeats`, medians), one of each kind a round and every other round in
reverse, so a drift through a bucket (the engine bench's alone times fell through buckets timed
kind by kind, session 61) falls on alone and co-run times alike.

Rates are in the simulator's unit, work done per second relative to that side alone with no MPS:
`none_corun` = alone(none) / corun(none), `mps_alone` = alone(none) / alone(mps), `mps_corun` =
alone(none) / corun(mps). The profile takes the median over buckets; each bucket's rates stay in
its measurements, so the spread across batch sizes and token counts is on record.

A measuring run writes its raw timings after every bucket to `<out>.raw.json` (atomically), so a
run stopped part-way (a device call's time limit) keeps every finished bucket;
`nodus calibrate-sharing --from-raw FILE` builds the profile from such a file, or from the
bucket lines of a calibrate-sharing log, without measuring. Buckets of the grid that were not
measured are listed in the profile (`measurements.sharing.missing`) and among its assumptions.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from calibration.measure import _requests, _train_batches
from sim.profile import RATE_MAX, drop_two_engine_rate

SIDES = ("engine", "trainer")
RATES = ("none_corun", "mps_alone", "mps_corun")  # the profile's sharing section
DONE = {"engine": "generated", "trainer": "trained"}  # each side's answer to a task
BATCHES = (64, 256, 512)  # default engine batch buckets
TRAIN_TOKENS = (16384, 49152)  # default trainer step token buckets
TIMES = ("engine_alone_s", "engine_corun_s", "trainer_alone_s", "trainer_corun_s")  # a bucket's timings


def interleaved(passes) -> dict[str, list[float]]:
    """Time each pass's kinds in turn (``(kind, timed)`` pairs, ``timed()`` returning seconds), every
    other pass in reverse (ABBA): each kind's timings, in order. A drift through a bucket falls on every
    kind alike, which a bucket timed kind by kind does not (the engine bench's alone times fell through
    such buckets on the H100 while its beside times held to 1%, session 61). ``passes`` may be a
    generator: each pass is built as it comes."""
    got: dict[str, list[float]] = {}
    for i, kinds in enumerate(passes):
        for k, timed in (kinds if i % 2 == 0 else kinds[::-1]):
            got.setdefault(k, []).append(timed())
    return got


class _Pair:
    """One engine and one trainer process (a one-stack Cluster) with 8 calibration jobs."""

    def __init__(self, model: str, sharing: str, device: str, max_batch: int, mb_tokens: int,
                 engine_memory: float, enforce_eager: bool, adapters: int = 8, rank: int = 16,
                 trainer_graphs: bool = False, tuned_lora_kernels: bool = True):
        from real.backend import Cluster, RealOptions
        from real.trainer import JobConfig

        opts = RealOptions(model=model, mode="synthetic", device=device, engine_memory=engine_memory,
                           enforce_eager=enforce_eager, warmup=False, trainer_graphs=trainer_graphs,
                           tuned_lora_kernels=tuned_lora_kernels,
                           # torch's own CPU threads, as the base profile's train terms were measured
                           # (nodus calibrate's trainer, environment.trainer_cpu_threads None).
                           trainer_cpu_threads=0)
        self.c = Cluster(opts, sharing, 1, max_loras=adapters, max_rank=rank, max_num_seqs=max_batch,
                         max_tokens_per_microbatch=mb_tokens)
        self.vocab = self.c.vocab_size
        self.jobs = [f"cal{a}" for a in range(adapters)]
        self.dir = Path(tempfile.mkdtemp(prefix="nodus-corun-"))
        self._n = 0
        for a, job in enumerate(self.jobs):
            path = str(self.dir / job / "v{v}")
            self.c.trainers[0].put(("add", self._tag(), job, JobConfig(rank=rank, alpha=2 * rank, lr=1e-6, seed=a),
                                    path))
            self._wait("added")
        self.c.engines[0].put(("publish", self._tag(), [(j, 0, str(self.dir / j / "v0")) for j in self.jobs]))
        self._wait("published")
        self.rng = np.random.default_rng(0)

    def _tag(self) -> str:
        self._n += 1
        return f"c{self._n}"

    def _wait(self, kind: str):
        while True:
            msg = self.c.get(timeout=1800)
            if msg[0] == kind:
                return msg

    def gen_request(self, batch: int, prompt: int, length: int):
        return _requests(len(self.jobs), batch, prompt, length, self.vocab, self.rng)

    def train_batches(self, tokens: int):
        batches = _train_batches(len(self.jobs), tokens, self.vocab, self.rng)
        return batches, {j: str(self.dir / j / "scratch") for j in batches}

    def send(self, side: str, work) -> str:
        tag = self._tag()
        if side == "engine":
            self.c.engines[0].put(("gen", tag, work))
        else:
            self.c.trainers[0].put(("train", tag, work[0], work[1], None, None))
        return tag

    def alone(self, side: str, work, repeats: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.monotonic()
            self.send(side, work)
            self._wait(DONE[side])
            times.append(time.monotonic() - t0)
        return float(np.median(times))

    def corun(self, fg: str, fg_work, bg_work, repeats: int) -> float:
        """Seconds of one `fg` task while the other side runs back to back."""
        bg = "trainer" if fg == "engine" else "engine"
        times = []
        for _ in range(repeats):
            bg_tag = self.send(bg, bg_work)
            time.sleep(0.05)  # the background is running before the foreground starts
            t0 = time.monotonic()
            fg_tag = self.send(fg, fg_work)
            end = None
            while end is None:
                msg = self.c.get(timeout=1800)
                if msg[0] == DONE[fg] and msg[1] == fg_tag:
                    end = time.monotonic()
                elif msg[0] == DONE[bg] and msg[1] == bg_tag:
                    bg_tag = self.send(bg, bg_work)
            times.append(end - t0)
            while True:  # drain the last background task
                msg = self.c.get(timeout=1800)
                if msg[0] == DONE[bg] and msg[1] == bg_tag:
                    break
        return float(np.median(times))

    def close(self) -> None:
        self.c.close()


def measure_sharing(model: str, modes=("none", "mps"), batches=BATCHES, train_tokens=TRAIN_TOKENS,
                    prompt: int = 128, length: int = 128, repeats: int = 2, device: str = "auto",
                    engine_memory: float = 0.35, enforce_eager: bool = False, mb_tokens: int = 16384,
                    log=print, raw_path: str | Path | None = None, make_pair=_Pair,
                    trainer_graphs: bool = False, tuned_lora_kernels: bool = True) -> dict:
    """Raw timings per mode and bucket, and the rates the profile's sharing section takes. With
    `raw_path`, the timings so far are written there after every bucket (see `write_raw`);
    `make_pair` builds each mode's engine-and-trainer pair (tests pass a timed stand-in);
    `trainer_graphs`: the trainer's micro-batches as CUDA graphs; `tuned_lora_kernels`: the
    engine with the shipped tuned LoRA kernel configs (real/lora_kernels.py) or vLLM's."""
    raw: dict = {}
    settings = {"modes": list(modes), "batches": list(batches), "train_tokens": list(train_tokens),
                "prompt": prompt, "length": length, "repeats": repeats, "engine_memory": engine_memory}
    if trainer_graphs:
        settings["trainer_graphs"] = True
    settings["tuned_lora_kernels"] = tuned_lora_kernels
    settings["trainer_cpu_threads"] = None  # torch's own count (_Pair), as nodus calibrate measures
    for mode in modes:
        pair = make_pair(model, mode, device, max(batches), mb_tokens, engine_memory, enforce_eager,
                         trainer_graphs=trainer_graphs, tuned_lora_kernels=tuned_lora_kernels)
        try:
            gen = {b: pair.gen_request(b, prompt, length) for b in batches}
            train = {t: pair.train_batches(t) for t in train_tokens}
            # Warm-up at every shape (kernel selection, graphs, allocator growth): not timed.
            for w in gen.values():
                pair.alone("engine", w, 1)
            for w in train.values():
                pair.alone("trainer", w, 1)
            rows = raw[mode] = []
            for b in batches:
                for t in train_tokens:
                    # One timing of each kind a round, every other round in reverse (ABBA), medians: a
                    # drift through a bucket falls on alone and co-run times alike (the engine bench's
                    # alone times fell through buckets timed kind by kind on the H100, session 61).
                    kinds = [("e_co", lambda: pair.corun("engine", gen[b], train[t], 1)),
                             ("e_alone", lambda: pair.alone("engine", gen[b], 1)),
                             ("t_alone", lambda: pair.alone("trainer", train[t], 1)),
                             ("t_co", lambda: pair.corun("trainer", train[t], gen[b], 1))]
                    med = {k: float(np.median(v)) for k, v in interleaved([kinds] * repeats).items()}
                    rows.append({"batch": b, "tokens": t, "engine_alone_s": med["e_alone"],
                                 "trainer_alone_s": med["t_alone"], "engine_corun_s": med["e_co"],
                                 "trainer_corun_s": med["t_co"]})
                    if raw_path is not None:
                        write_raw(raw_path, raw, settings)
                    log(bucket_line(mode, rows[-1]))
        finally:
            pair.close()
    return measured_from_raw(raw, settings)


def bucket_line(mode: str, row: dict) -> str:
    """One bucket's line in the calibrate-sharing log (`parse_sharing_log` reads it back)."""
    return (f"{mode}: batch {row['batch']} / {row['tokens']} tokens: engine {row['engine_alone_s']:.3f} s alone, "
            f"{row['engine_corun_s']:.3f} s co-running; trainer {row['trainer_alone_s']:.3f} s alone, "
            f"{row['trainer_corun_s']:.3f} s co-running")


_NUM = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)"
_LINE = re.compile(rf"\b(none|mps): batch (\d+) / (\d+) tokens: engine {_NUM} s alone, {_NUM} s co-running; "
                   rf"trainer {_NUM} s alone, {_NUM} s co-running\s*$")


def raw_path_for(out: str | Path) -> Path:
    """Where a measuring run keeps its raw timings: `x.json` -> `x.raw.json`, beside the profile."""
    out = Path(out)
    return out.with_suffix(".raw.json") if out.suffix == ".json" else out.with_name(out.name + ".raw.json")


def write_raw(path: str | Path, raw: dict, settings: dict) -> None:
    """The timings so far (`raw`: per mode, the finished buckets' rows) and the run's `settings`,
    written to a temporary file and renamed over `path`: a run killed at any moment leaves either
    the previous complete file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"raw": raw, "settings": settings}, indent=1) + "\n")
    os.replace(tmp, path)


def fresh_raw_path(out: str | Path, tool: str, log=print) -> Path:
    """The raw-timings file a measuring run of ``tool`` writes beside ``out``, refused where one is
    there already (an earlier run's timings, which ``--from-raw`` can still build a profile from)."""
    raw_path = raw_path_for(out)
    if raw_path.exists():
        raise FileExistsError(f"{str(raw_path)!r} exists (the raw timings of an earlier run with this --out?): "
                              f"build its profile with --from-raw {raw_path}, or move it away")
    log(f"raw timings go to {raw_path} after every bucket (a stopped run: nodus {tool} --from-raw {raw_path})")
    return raw_path


def parse_sharing_log(text: str) -> dict:
    """The bucket lines of a calibrate-sharing log as `raw` (per mode, rows in log order); every
    other line (vLLM's, progress bars, warnings) is ignored. A bucket twice is an error: two runs'
    logs in one file cannot be told apart."""
    raw: dict = {}
    for line in text.splitlines():
        m = _LINE.search(line)
        if m is None:
            continue
        mode, b, t, e_alone, e_co, t_alone, t_co = m.groups()
        row = {"batch": int(b), "tokens": int(t), "engine_alone_s": float(e_alone),
               "trainer_alone_s": float(t_alone), "engine_corun_s": float(e_co), "trainer_corun_s": float(t_co)}
        rows = raw.setdefault(mode, [])
        if any((r["batch"], r["tokens"]) == (row["batch"], row["tokens"]) for r in rows):
            raise ValueError(f"{mode} batch {b} / {t} tokens appears twice (two runs' logs in one file?)")
        rows.append(row)
    return raw


def _check_rows(raw: dict) -> None:
    for mode, rows in raw.items():
        if mode not in ("none", "mps") or not isinstance(rows, list):
            raise ValueError(f"raw timings: mode {mode!r} is not none or mps with a list of buckets")
        for r in rows:
            if not isinstance(r, dict) or not all(isinstance(r.get(k), int) for k in ("batch", "tokens")) \
                    or not all(isinstance(r.get(k), (int, float)) and r[k] > 0 for k in TIMES):
                raise ValueError(f"raw timings: {mode} bucket {r!r} needs integer batch and tokens and positive "
                                 f"{', '.join(TIMES)}")


def read_raw(path: str | Path, grid: dict) -> tuple[dict, dict]:
    """(raw, settings) from a raw-timings JSON (`write_raw`) or a calibrate-sharing log. A log does
    not say which grid its run measured: `grid` (modes, batches, train_tokens: the run's flags)
    does, and a log bucket outside it is an error. Errors name the file and the problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise FileNotFoundError(f"--from-raw {str(path)!r}: cannot read it ({err.strerror or err})") from None
    try:
        if text.lstrip().startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(f"not valid JSON ({err})") from None
            if not isinstance(data.get("raw"), dict) or not isinstance(data.get("settings"), dict):
                raise ValueError("a raw-timings JSON has 'raw' (timings per mode) and 'settings' objects")
            raw, settings = data["raw"], dict(data["settings"])
            for k in ("batches", "train_tokens"):
                if not isinstance(settings.get(k), list):
                    raise ValueError(f"settings.{k} (the measured grid) is missing")
            settings.setdefault("modes", sorted(raw))
        else:
            raw = parse_sharing_log(text)
            if not raw:
                raise ValueError("no bucket lines ('none: batch 64 / 16384 tokens: engine ... co-running') in it")
            settings = {"modes": list(grid["modes"]), "batches": list(grid["batches"]),
                        "train_tokens": list(grid["train_tokens"]), "grid_from": "command line (a log has none)"}
            for mode, rows in raw.items():
                for r in rows:
                    if mode not in settings["modes"] or r["batch"] not in settings["batches"] \
                            or r["tokens"] not in settings["train_tokens"]:
                        raise ValueError(f"{mode} batch {r['batch']} / {r['tokens']} tokens is outside --modes "
                                         f"{','.join(settings['modes'])} --batches "
                                         f"{','.join(map(str, settings['batches']))} --train-tokens "
                                         f"{','.join(map(str, settings['train_tokens']))}: give the measuring "
                                         f"run's flags")
        _check_rows(raw)
        if not raw.get("none"):
            raise ValueError("no bucket of mode 'none' (the rates' unit) in it")
    except ValueError as err:
        raise ValueError(f"--from-raw {str(path)!r}: {err}") from None
    return raw, settings


def missing_buckets(raw: dict, settings: dict) -> list[dict]:
    """The buckets of the settings' grid (modes x batches x train_tokens) with no timings."""
    have = {(m, r["batch"], r["tokens"]) for m, rows in raw.items() for r in rows}
    return [{"mode": m, "batch": b, "tokens": t} for m in settings["modes"] for b in settings["batches"]
            for t in settings["train_tokens"] if (m, b, t) not in have]


def measured_from_raw(raw: dict, settings: dict, source: dict | None = None) -> dict:
    """The profile's `measurements.sharing`: raw timings, rates, settings, whether every bucket of
    the grid was measured (`complete`; else `missing`) and, for `--from-raw`, the file (`from_raw`)."""
    out = {"raw": raw, "rates": sharing_rates(raw), "settings": settings}
    missing = missing_buckets(raw, settings)
    out["complete"] = not missing
    if missing:
        out["missing"] = missing
    if source is not None:
        out["from_raw"] = source
    return out


def _is_plausible(rate: float) -> bool:
    """Whether a profile can hold the rate (sim.profile.RATE_MAX): a larger one timed something else."""
    return rate <= RATE_MAX


def _plausible(values) -> list[float]:
    """The rates a profile can hold (``_is_plausible``)."""
    return [float(v) for v in values if _is_plausible(v)]


def sharing_rates(raw: dict) -> dict:
    """Per bucket and as medians: the profile's none_corun, mps_alone and mps_corun rates.
    Needs the `none` mode (the unit); `mps` rates only where `mps` was measured."""
    if not raw.get("none"):
        raise ValueError("sharing rates are relative to running alone without MPS: measure mode 'none'")
    base = {(r["batch"], r["tokens"]): r for r in raw["none"]}
    per_bucket = []
    for key, r in base.items():
        row = {"batch": key[0], "tokens": key[1],
               "none_corun": {s: r[f"{s}_alone_s"] / r[f"{s}_corun_s"] for s in SIDES}}
        m = next((x for x in raw.get("mps", []) if (x["batch"], x["tokens"]) == key), None)
        if m is not None:
            row["mps_alone"] = {s: r[f"{s}_alone_s"] / m[f"{s}_alone_s"] for s in SIDES}
            row["mps_corun"] = {s: r[f"{s}_alone_s"] / m[f"{s}_corun_s"] for s in SIDES}
        per_bucket.append(row)
    out: dict = {"per_bucket": per_bucket}
    # A bucket whose side ran more than RATE_MAX times faster than alone (the profile's bound) timed
    # something else (the fresh clone's CI-like run on a busy 2-core host: a trainer 2.81 s alone,
    # 0.46 s beside the engine): left out of that rate's median and range, and named.
    implausible = [{"batch": b["batch"], "tokens": b["tokens"], "rate": name, "side": s, "value": float(b[name][s])}
                   for b in per_bucket for name in RATES if name in b for s in SIDES if not _is_plausible(b[name][s])]
    if implausible:
        out["implausible"] = implausible
    for name in RATES:
        vals = [b[name] for b in per_bucket if name in b]
        if not vals:
            continue
        out[name], out[name + "_range"] = {}, {}
        for s in SIDES:
            ok = _plausible(v[s] for v in vals)
            if not ok:
                raise ValueError(f"{name}.{s}: every bucket measured it above {RATE_MAX} (co-running or under MPS "
                                 f"more than {RATE_MAX}x as fast as alone: {', '.join(f'{v[s]:.2f}' for v in vals)}); "
                                 "the timings were disturbed: measure again")
            out[name][s] = float(np.median(ok))
            out[name + "_range"][s] = [min(ok), max(ok)]
    return out


def corun_by_engine_batch(per_bucket: list[dict], overall: dict | None = None) -> list[dict]:
    """The profile's `sharing.corun_by_engine_batch`: per measured engine batch, the median over
    the train-token buckets of each co-run rate, leaving out values above RATE_MAX (``sharing_rates``);
    a batch with none left for a side takes ``overall`` (the rate over every bucket)."""
    out = []
    for batch in sorted({b["batch"] for b in per_bucket}):
        rows = [b for b in per_bucket if b["batch"] == batch]
        entry: dict = {"batch": int(batch)}
        for name in ("none_corun", "mps_corun"):
            vals = [r[name] for r in rows if name in r]
            if vals:
                entry[name] = {}
                for s in SIDES:
                    ok = _plausible(v[s] for v in vals)
                    entry[name][s] = float(np.median(ok)) if ok else float(((overall or {}).get(name) or {})[s])
        out.append(entry)
    return out


def apply_sharing(profile: dict, measured: dict) -> dict:
    """The profile with its sharing section's measured parts replaced, and its assumptions updated."""
    rates = measured["rates"]
    got = [k for k in RATES if k in rates]
    for k in got:
        profile["sharing"][k] = dict(rates[k])
    from calibration.run_settings import settings_text

    # Measured with nodus's default MPS settings: the profile's MPS rates are now the defaults'.
    was = profile["sharing"].get("controls") or {}
    mps_got = [k for k in got if k.startswith("mps_")]
    if mps_got:
        profile["sharing"]["controls"] = {}
    mixed = None
    if was and mps_got and len(mps_got) < len([k for k in RATES if k.startswith("mps_")]):
        mixed = {"id": "sharing-controls-mixed", "value": None,
                 "what": f"MPS rates measured at the default MPS settings ({', '.join(mps_got)}) beside the base's "
                         f"others, fitted under {settings_text(was)}"}
    if rates.get("per_bucket"):
        profile["sharing"]["corun_by_engine_batch"] = corun_by_engine_batch(rates["per_bucket"], rates)
    profile.setdefault("measurements", {})["sharing"] = dict(measured, rates_measured=got)
    if got:
        drop_two_engine_rate(profile)  # fitted beside the rates just replaced: stale now
    # Rates `nodus fit` fitted on the base are replaced here: its notes go when every rate is measured.
    gone = {"sharing-from-base", "sharing-buckets-missing"} | ({"sharing-controls-mixed"} if mps_got else set())
    if len(got) == len(RATES):
        gone.add("sharing-partly-fitted")
    keep = [a for a in profile.get("assumptions", []) if a["id"] not in gone] + ([mixed] if mixed else [])
    if len(got) != len(RATES):
        keep.append({"id": "sharing-from-base", "value": None,
                     "what": f"sharing rates not measured in this calibration "
                             f"({', '.join(sorted(set(RATES) - set(got)))}) are the base profile's"})
    if measured.get("missing"):
        keep.append({"id": "sharing-buckets-missing", "value": None, "what": _missing_text(measured["missing"])})
    for a in keep:
        if a["id"] == "sharing-constant":
            a["what"] = ("co-run rates by the engine's running batch (medians over the measured train-token "
                         "buckets, linear between the measured batches); the MPS-alone rates are medians over "
                         "every bucket (per-bucket rates under measurements.sharing)")
    profile["assumptions"] = keep
    return profile


def _missing_text(missing: list[dict]) -> str:
    by_mode: dict = {}
    for m in missing:
        by_mode.setdefault(m["mode"], []).append(f"batch {m['batch']} / {m['tokens']} tokens")
    return ("buckets not measured (the calibration stopped early): "
            + "; ".join(f"{mode}: {', '.join(b)}" for mode, b in by_mode.items())
            + ". Their mode's rates are the medians of its measured buckets, and its co-run rates by engine "
              "batch stop at the nearest measured batch")


def calibrate_sharing(model: str | None, base: str, out: str | Path, modes=("none", "mps"), log=print,
                      from_raw: str | Path | None = None, **settings) -> dict:
    """`nodus calibrate-sharing`: measure (raw timings kept beside `out` as they come), or read
    `from_raw` (a raw-timings JSON or a calibrate-sharing log), then write the base profile with
    the measured rates."""
    from nodus.config import ConfigError
    from sim.profile import (add_source, drop_base_validation, profile_dict, profile_lora_kernels, profile_step_mode,
                             refuse_existing, write_profile)

    refuse_existing(out, "calibrate")
    if any(m not in ("none", "mps") for m in modes) or "none" not in modes:
        raise ConfigError(f"--modes {','.join(modes)!r}: choose from none,mps, with none (the rates' unit) included")
    if from_raw is None and not model:
        raise ConfigError("calibrate-sharing: --model is required to measure (or --from-raw FILE builds the "
                          "profile from a run's raw timings or log, without measuring)")
    prof = profile_dict(base)
    if from_raw is not None:
        grid = {"modes": modes, "batches": settings.get("batches", BATCHES),
                "train_tokens": settings.get("train_tokens", TRAIN_TOKENS)}
        raw, got = read_raw(from_raw, grid)
        fmt = "log" if "grid_from" in got else "raw json"
        measured = measured_from_raw(raw, got, source={"file": str(from_raw), "format": fmt})
        source = f"nodus calibrate-sharing --from-raw {Path(from_raw).name} ({','.join(got['modes'])})"
    else:
        raw_path = fresh_raw_path(out, "calibrate-sharing", log)
        # The co-run rates of the trainer the base profile's train terms describe, beside the engine
        # its engine terms describe (its LoRA kernels).
        cap = (prof.get("environment") or {}).get("trainer_cpu_threads")
        if cap:
            raise ValueError(f"nodus calibrate-sharing: base {base!r}'s train terms were measured with the trainer on "
                             f"{cap} CPU threads (environment.trainer_cpu_threads); the co-run bench measures with "
                             "torch's own count, as nodus calibrate does: give it a base measured that way")
        graphs = profile_step_mode(prof) != "eager"
        measured = measure_sharing(model, modes=modes, log=log, raw_path=raw_path, trainer_graphs=graphs,
                                   tuned_lora_kernels=profile_lora_kernels(prof) == "tuned", **settings)
        source = f"nodus calibrate-sharing ({','.join(modes)}{', graphed trainer' if graphs else ''})"
    apply_sharing(prof, measured)
    # The base's validation error bar was measured with other sharing rates (as every fit drops it).
    drop_base_validation(prof)
    add_source(prof, source)
    write_profile(prof, out, "calibrate")
    return prof
