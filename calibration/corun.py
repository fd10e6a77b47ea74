"""Engine and trainer sharing one GPU, measured the way the real backend runs them: two processes.

For each sharing mode (`none`: the driver time-slices them; `mps`: the backend's own MPS daemon)
and each bucket (engine batch, trainer tokens), three timings:

- the engine alone: one generation of `batch` sequences (prompt and forced response lengths);
- the trainer alone: one step of `tokens` tokens over 8 adapters (saves included, as in a run);
- each side while the other is kept busy: the trainer steps back to back while the engine
  generates once, and the engine generates back to back while the trainer steps once.

Rates are in the simulator's unit, work done per second relative to that side alone with no MPS:
`none_corun` = alone(none) / corun(none), `mps_alone` = alone(none) / alone(mps), `mps_corun` =
alone(none) / corun(mps). The profile takes the median over buckets; each bucket's rates stay in
its measurements, so the spread across batch sizes and token counts is on record.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from calibration.measure import _requests, _train_batches

SIDES = ("engine", "trainer")
RATES = ("none_corun", "mps_alone", "mps_corun")  # the profile's sharing section
DONE = {"engine": "generated", "trainer": "trained"}  # each side's answer to a task


class _Pair:
    """One engine and one trainer process (a one-stack Cluster) with 8 calibration jobs."""

    def __init__(self, model: str, sharing: str, device: str, max_batch: int, mb_tokens: int,
                 engine_memory: float, enforce_eager: bool, adapters: int = 8, rank: int = 16):
        from real.backend import Cluster, RealOptions
        from real.trainer import JobConfig

        opts = RealOptions(model=model, mode="synthetic", device=device, engine_memory=engine_memory,
                           enforce_eager=enforce_eager, warmup=False)
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


def measure_sharing(model: str, modes=("none", "mps"), batches=(64, 256, 512), train_tokens=(16384, 49152),
                    prompt: int = 128, length: int = 128, repeats: int = 2, device: str = "auto",
                    engine_memory: float = 0.35, enforce_eager: bool = False, mb_tokens: int = 16384,
                    log=print) -> dict:
    """Raw timings per mode and bucket, and the rates the profile's sharing section takes."""
    raw: dict = {}
    for mode in modes:
        pair = _Pair(model, mode, device, max(batches), mb_tokens, engine_memory, enforce_eager)
        try:
            gen = {b: pair.gen_request(b, prompt, length) for b in batches}
            train = {t: pair.train_batches(t) for t in train_tokens}
            # Warm-up at every shape (kernel selection, graphs, allocator growth): not timed.
            for w in gen.values():
                pair.alone("engine", w, 1)
            for w in train.values():
                pair.alone("trainer", w, 1)
            rows = []
            for b in batches:
                for t in train_tokens:
                    e_alone = pair.alone("engine", gen[b], repeats)
                    t_alone = pair.alone("trainer", train[t], repeats)
                    e_co = pair.corun("engine", gen[b], train[t], repeats)
                    t_co = pair.corun("trainer", train[t], gen[b], repeats)
                    rows.append({"batch": b, "tokens": t, "engine_alone_s": e_alone, "trainer_alone_s": t_alone,
                                 "engine_corun_s": e_co, "trainer_corun_s": t_co})
                    log(f"{mode}: batch {b} / {t} tokens: engine {e_alone:.3f} s alone, {e_co:.3f} s co-running; "
                        f"trainer {t_alone:.3f} s alone, {t_co:.3f} s co-running")
            raw[mode] = rows
        finally:
            pair.close()
    return {"raw": raw, "rates": sharing_rates(raw),
            "settings": {"batches": list(batches), "train_tokens": list(train_tokens), "prompt": prompt,
                         "length": length, "repeats": repeats, "engine_memory": engine_memory}}


def sharing_rates(raw: dict) -> dict:
    """Per bucket and as medians: the profile's none_corun, mps_alone and mps_corun rates.
    Needs the `none` mode (the unit); `mps` rates only where `mps` was measured."""
    if "none" not in raw:
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
    out = {"per_bucket": per_bucket}
    for name in RATES:
        vals = [b[name] for b in per_bucket if name in b]
        if vals:
            out[name] = {s: float(np.median([v[s] for v in vals])) for s in SIDES}
            out[name + "_range"] = {s: [float(min(v[s] for v in vals)), float(max(v[s] for v in vals))]
                                    for s in SIDES}
    return out


def corun_by_engine_batch(per_bucket: list[dict]) -> list[dict]:
    """The profile's `sharing.corun_by_engine_batch`: per measured engine batch, the median over
    the train-token buckets of each co-run rate."""
    out = []
    for batch in sorted({b["batch"] for b in per_bucket}):
        rows = [b for b in per_bucket if b["batch"] == batch]
        entry: dict = {"batch": int(batch)}
        for name in ("none_corun", "mps_corun"):
            vals = [r[name] for r in rows if name in r]
            if vals:
                entry[name] = {s: float(np.median([v[s] for v in vals])) for s in SIDES}
        out.append(entry)
    return out


def apply_sharing(profile: dict, measured: dict) -> dict:
    """The profile with its sharing section's measured parts replaced, and its assumptions updated."""
    rates = measured["rates"]
    got = [k for k in RATES if k in rates]
    for k in got:
        profile["sharing"][k] = dict(rates[k])
    if rates.get("per_bucket"):
        profile["sharing"]["corun_by_engine_batch"] = corun_by_engine_batch(rates["per_bucket"])
    profile.setdefault("measurements", {})["sharing"] = measured
    keep = [a for a in profile.get("assumptions", []) if a["id"] != "sharing-from-base"]
    if len(got) != len(RATES):
        keep.append({"id": "sharing-from-base", "value": None,
                     "what": f"sharing rates not measured in this calibration "
                             f"({', '.join(sorted(set(RATES) - set(got)))}) are the base profile's"})
    for a in keep:
        if a["id"] == "sharing-constant":
            a["what"] = ("co-run rates by the engine's running batch (medians over the measured train-token "
                         "buckets, linear between the measured batches); the MPS-alone rates are medians over "
                         "every bucket (per-bucket rates under measurements.sharing)")
    profile["assumptions"] = keep
    return profile


def calibrate_sharing(model: str, base: str, out: str | Path, modes=("none", "mps"), log=print, **settings) -> dict:
    """`nodus calibrate-sharing`: measure, then write the base profile with the measured rates."""
    from sim.profile import add_source, profile_dict, refuse_existing, write_profile

    refuse_existing(out, "calibrate")
    if any(m not in ("none", "mps") for m in modes) or "none" not in modes:
        from nodus.config import ConfigError

        raise ConfigError(f"--modes {','.join(modes)!r}: choose from none,mps, with none (the rates' unit) included")
    prof = profile_dict(base)
    measured = measure_sharing(model, modes=modes, log=log, **settings)
    apply_sharing(prof, measured)
    add_source(prof, f"nodus calibrate-sharing ({','.join(modes)})")
    write_profile(prof, out, "calibrate")
    return prof
