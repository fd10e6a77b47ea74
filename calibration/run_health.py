"""The state of the host and GPU a recorded run ran on, read from its summary's diagnostics: the
host probe at its start and end, the host monitor (steal, cgroup throttling, other processes'
cores, the core clock), the GPU monitor (busy share, SM clock, slowdown reasons), the engine's
step record and JIT compiles, and which machine it was. Each figure has its flags: runs whose host
or GPU was slower than the others' while they ran, flagged (never dropped), so a report can say
when the machine, not only the simulator, may explain an error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nodus.gpumon import SLOWDOWN_REASONS


HOST_SLOW = 1.3  # a run whose host probe took this many times the validated runs' median is flagged
GPU_CLOCK_LOW = 0.05  # a run whose busy SM clock lies this far under the validated runs' median is flagged
GPU_THROTTLE = 0.10  # ... or one with a slowdown reason (power cap, thermal, ...) active in this share of samples
# The host monitor (nodus.hostmon) flags a run whose CPUs lost this share of the time they wanted
# to run to the hypervisor (steal), whose cgroup was quota-throttled in this share of its periods,
# where other processes than the run's took this many cores, or whose cores' clock sat this far
# under the median; and names (not flags) a run whose busiest thread used this share of a core.
HOSTMON_STEAL, HOSTMON_CG_THROTTLED, HOSTMON_OTHER_CORES, HOSTMON_MHZ_LOW = 0.05, 0.05, 1.0, 0.05
HOSTMON_ONE_THREAD = 0.9


def run_host_probe(summary: dict) -> dict | None:
    """The slowest of a run's host probes (``nodus.outdir.host_probe``, at the start and end of each
    GPU's run): the largest loop and file seconds and load average; None for a run without one."""
    probes = [p for d in summary.get("diagnostics", []) for p in (d.get("host_probe") or {}).values()
              if isinstance(p, dict)]
    out = {}
    for k in ("cpu_loop_s", "file_rw_s", "load1"):
        vals = [p[k] for p in probes if isinstance(p.get(k), (int, float))]
        if vals:
            out[k] = float(max(vals))
    return out or None


def run_started(summary: dict) -> float | None:
    """When a run began, in Unix seconds: its earliest host probe's start (``nodus.outdir.host_probe``
    records the time it ran); None for a run without one."""
    starts = [p["unix_s"] for d in summary.get("diagnostics", []) for p in (d.get("host_probe") or {}).values()
              if isinstance(p, dict) and isinstance(p.get("unix_s"), (int, float))]
    return float(min(starts)) if starts else None


def minutes_apart(start: float | None, others: list) -> float | None:
    """Minutes between a run's start and the farthest of ``others``' starts (``run_started``: Unix
    seconds); None where any of them is unrecorded (runs before the host probe's times) or there is
    no other."""
    if start is None or not others or None in others:
        return None
    return max(abs(start - t) for t in others) / 60


def run_machine(summary: dict) -> str | None:
    """Which machine a run ran on, as one name: its host name and boot id (``nodus.outdir.machine``;
    two GPUs of one host are one machine), else its GPUs' UUIDs (``nodus.gpumon``) for a run that
    recorded those alone; None for a run recorded before either was (before session 35). The real
    backend records both, so two runs of it are always named the same way."""
    diags = summary.get("diagnostics", [])
    hosts = sorted({f"{m.get('hostname')}/{m.get('boot_id')}" for d in diags
                    for m in [d.get("machine") or {}] if m.get("hostname") or m.get("boot_id")})
    if hosts:
        return ",".join(hosts)
    uuids = sorted({g["uuid"] for d in diags for g in ((d.get("gpu_monitor") or {}).get("gpus") or {}).values()
                    if isinstance(g, dict) and g.get("uuid")})
    return ",".join(uuids) or None


def _label_runs(rows: list[dict], *entries: list[dict]) -> None:
    """Each entry's run by the shortest trailing path no other of ``rows`` shares (``unique_names``),
    under "label": runs of one folder name from several days stay apart in a report's lines."""
    runs = [r["run"] for r in rows]
    names = dict(zip(runs, unique_names(runs)))
    for entry in (e for es in entries for e in es):
        entry["label"] = names.get(entry["run"], Path(entry["run"]).name)


def _run_name(entry: dict) -> str:
    """A flagged run as a report names it: its label (``_label_runs``), else its folder's name."""
    return entry.get("label") or Path(entry["run"]).name


def host_flags(rows: list[dict]) -> dict:
    """Runs whose host probe took more than ``HOST_SLOW`` times the median of the validated runs'
    probes: their host was slower than the others' while they ran (other load, a throttled CPU, a
    slow scratch disk), so their error may be the host's, not the simulator's. Flagged, never
    dropped."""
    probed = [r for r in rows if r.get("host_probe")]
    median = {}
    for k in ("cpu_loop_s", "file_rw_s"):
        vals = [r["host_probe"][k] for r in probed if k in r["host_probe"]]
        if vals:
            median[k] = float(np.median(vals))
    flagged = []
    for r in probed:
        slower = {k: r["host_probe"][k] / m for k, m in median.items()
                  if m > 0 and r["host_probe"].get(k, 0) > HOST_SLOW * m}
        if slower:
            flagged.append({"run": r["run"], "slower": slower})
    _label_runs(rows, flagged)
    return {"runs_with_probe": len(probed), "runs": len(rows), "median": median, "threshold": HOST_SLOW,
            "flagged": flagged}


def run_gpu_monitor(summary: dict) -> dict | None:
    """The slowest GPU state a run's GPU monitors recorded (``nodus.gpumon``, one per GPU's run):
    the lowest SM clock while busy (the mean over samples above 50% utilisation), the largest
    share of samples each slowdown reason was active in, and the tightest power limit; None for a
    run without one (recorded before session 26), ``{"available": False, "why": ...}`` for one
    whose monitors recorded no figures (no GPU, no NVML)."""
    mons = [d["gpu_monitor"] for d in summary.get("diagnostics", []) if isinstance(d.get("gpu_monitor"), dict)]
    if not mons:
        return None
    gpus = [g for m in mons if m.get("available") for g in (m.get("gpus") or {}).values()]
    if not gpus:
        return {"available": False, "why": "; ".join(sorted({str(m.get("why")) for m in mons}))}
    busy = [g["busy"]["sm_clock_mhz"] for g in gpus if (g.get("busy") or {}).get("sm_clock_mhz") is not None]
    limits = [g["power_limit_w"] for g in gpus if g.get("power_limit_w") is not None]
    throttle = {}
    for reason in SLOWDOWN_REASONS:
        fracs = [(g.get("throttle") or {}).get(reason, 0.0) for g in gpus]
        if max(fracs) > 0:
            throttle[reason] = float(max(fracs))
    stopped = "; ".join(sorted({str(m["stopped_early"]) for m in mons if m.get("stopped_early")}))

    def weighted(get):  # over every GPU's samples (a dedicated arm's jobs are one monitor each)
        pairs = [(get(g), g.get("samples") or 0) for g in gpus]
        pairs = [(v, w) for v, w in pairs if v is not None and w > 0]
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else None

    return {"available": True, "busy_sm_clock_mhz": min(busy) if busy else None,
            "busy_fraction": weighted(lambda g: (g.get("busy") or {}).get("fraction")),
            "util_pct": weighted(lambda g: (g.get("util_pct") or {}).get("mean")),
            "max_sm_clock_mhz": max((g.get("max_sm_clock_mhz") or 0.0) for g in gpus) or None,
            "power_limit_w": min(limits) if limits else None, "throttle": throttle,
            **({"stopped_early": stopped} if stopped else {})}


def gpu_flags(rows: list[dict]) -> dict:
    """Runs whose GPU ran slow: a busy SM clock more than ``GPU_CLOCK_LOW`` under the median of
    the validated runs' busy clocks, or a slowdown reason (power cap, thermal, hardware slowdown)
    active in at least ``GPU_THROTTLE`` of the samples; also a run whose sampling stopped early (its
    figures cover part of it). Their error may be the GPU's state, not the simulator's: session
    25's 8-job shared-sync + MPS generations (512 sequences) took 3.10 s a step against 2.41-2.67 s
    on four other days with the host probe unchanged. Flagged, never dropped."""
    monitored = [r for r in rows if (r.get("gpu_monitor") or {}).get("available")]
    clocks = [r["gpu_monitor"]["busy_sm_clock_mhz"] for r in monitored
              if r["gpu_monitor"].get("busy_sm_clock_mhz") is not None]
    median = float(np.median(clocks)) if clocks else None
    flagged = []
    for r in monitored:
        m, why = r["gpu_monitor"], {}
        clock = m.get("busy_sm_clock_mhz")
        if median and clock is not None and clock < (1 - GPU_CLOCK_LOW) * median:
            why["busy_sm_clock"] = clock / median
        why.update({k: v for k, v in (m.get("throttle") or {}).items() if v >= GPU_THROTTLE})
        if m.get("stopped_early"):
            why["stopped_early"] = m["stopped_early"]
        if why:
            flagged.append({"run": r["run"], "busy_sm_clock_mhz": clock, "why": why})
    without = [r["gpu_monitor"] for r in rows if r.get("gpu_monitor") and not r["gpu_monitor"].get("available")]
    _label_runs(rows, flagged)
    return {"runs_with_monitor": len(monitored), "runs": len(rows), "runs_without_figures": len(without),
            "why_without_figures": sorted({str(m.get("why")) for m in without}),
            "median_busy_sm_clock_mhz": median, "clock_threshold": GPU_CLOCK_LOW, "throttle_threshold": GPU_THROTTLE,
            "flagged": flagged}


def gpu_flagged_text(flags: dict) -> str:
    """``gpu_flags``' flagged runs as 'run (busy SM clock 1650 MHz, 0.88x the median; sw_power_cap in
    30% of samples); ...' for a report."""
    def one(f: dict) -> str:
        parts = [f"busy SM clock {f['busy_sm_clock_mhz']:.0f} MHz, {v:.2f}x the median" if k == "busy_sm_clock"
                 else f"sampling stopped early: {v}" if k == "stopped_early"
                 else f"{k} in {v:.0%} of samples" for k, v in f["why"].items()]
        return f"{_run_name(f)} ({'; '.join(parts)})"
    return "; ".join(one(f) for f in flags["flagged"])


def _monitor_preamble(flags: dict, name: str, since: int) -> tuple[str, str | None]:
    """A monitor's flags (``gpu_flags``, ``host_monitor_flags``) as the sentence on the runs
    without figures from it, and the whole paragraph where no run has figures (else None)."""
    without = (f"{flags['runs_without_figures']} of {flags['runs']} runs have no figures from it: "
               f"{'; '.join(flags['why_without_figures'])}." if flags.get("runs_without_figures") else "")
    if not flags.get("runs_with_monitor"):
        return without, f"{name}: " + (without or f"no run records one (recorded before session {since}).")
    return without, None


def gpu_text(flags: dict) -> str:
    """The report's paragraph on ``gpu_flags``."""
    without, only = _monitor_preamble(flags, "GPU monitor", 26)
    if only:
        return only
    med = flags["median_busy_sm_clock_mhz"]
    head = (f"GPU monitor (NVML: SM clock, power, temperature and throttle reasons through each run; "
            f"{flags['runs_with_monitor']} of {flags['runs']} runs have one): median SM clock while busy "
            + ("-" if med is None else f"{med:.0f} MHz") + ". ")
    rule = (f"a busy SM clock more than {flags['clock_threshold']:.0%} under the median, or a slowdown reason in "
            f"{flags['throttle_threshold']:.0%} of samples or more")
    tail = f" {without}" if without else ""
    if flags["flagged"]:
        return (head + f"On a slowed GPU ({rule}; their GPU, not only the simulator, may explain their error): "
                + gpu_flagged_text(flags) + "." + tail)
    return head + f"No run on a slowed GPU ({rule})." + tail


def _extreme(items: list[dict], get, f=max) -> float | None:
    """``f`` (max or min) of ``get(item)`` over the items that have it; None where none does."""
    vals = [v for v in (get(m) for m in items) if v is not None]
    return float(f(vals)) if vals else None


def run_host_monitor(summary: dict) -> dict | None:
    """The most contended host state a run's host monitors recorded (``nodus.hostmon``, one per GPU's
    run): the largest steal share, cgroup-throttled share and other processes' cores, the lowest
    mean core clock, and the run's own cores and busiest thread (the largest); None for a run
    without one (recorded before session 27), ``{"available": False, "why": ...}`` for one whose
    monitors recorded no figures."""
    mons = [d["host_monitor"] for d in summary.get("diagnostics", []) if isinstance(d.get("host_monitor"), dict)]
    if not mons:
        return None
    ok = [m for m in mons if m.get("available") and "cores_busy" in m]
    if not ok:
        return {"available": False, "why": "; ".join(sorted({str(m.get("why", "an empty window")) for m in mons}))}

    def top(key, f=max):
        return _extreme(ok, key, f)

    busiest = max((m["busiest_thread"] for m in ok if m.get("busiest_thread")), key=lambda b: b["core_frac"],
                  default=None)
    stopped = "; ".join(sorted({str(m["stopped_early"]) for m in mons if m.get("stopped_early")}))
    cg_error = "; ".join(sorted({str(m["cgroup_error"]) for m in mons if m.get("cgroup_error")}))
    return {"available": True, "steal_frac": top(lambda m: m.get("steal_frac")),
            "other_cores": top(lambda m: m.get("other_cores")), "run_cores": top(lambda m: m.get("run_cores")),
            "cgroup_throttled_frac": top(lambda m: (m.get("cgroup") or {}).get("throttled_frac")),
            "cpu_mhz": top(lambda m: (m.get("cpu_mhz") or {}).get("mean"), min),
            "busiest_thread": busiest, **({"stopped_early": stopped} if stopped else {}),
            **({"cgroup_error": cg_error} if cg_error else {})}


def run_engine_steps(summary: dict) -> dict | None:
    """A run's engine step figures (``real.stepstats``, ``diagnostics[].engine_steps``; one per
    GPU's run): the mean engine step in ms (each step counted once, weighted by steps across GPUs),
    the slowest generation's mean step over the fastest's, and the largest shares of the engines'
    busy time between steps, collecting results and in garbage collection; None for a run without
    them (recorded before session 28) or with no generation."""
    sums = [d["engine_steps"]["summary"] for d in summary.get("diagnostics", [])
            if isinstance(d.get("engine_steps"), dict) and (d["engine_steps"].get("summary") or {}).get("generations")]
    if not sums:
        return None
    per = [x["step_ms_per_generation"] for x in sums]
    counted = [x for x in sums if x.get("steps") and x.get("mean_step_ms") is not None]
    steps = sum(x["steps"] for x in counted)

    def top(key):
        return _extreme(sums, lambda x: x.get(key))

    lo = min(p["min"] for p in per)
    return {"generations": sum(x["generations"] for x in sums), "steps": steps,
            "mean_step_ms": sum(x["mean_step_ms"] * x["steps"] for x in counted) / steps if steps else None,
            "step_ms_spread": max(p["max"] for p in per) / lo if lo > 0 else None,
            "between_share": top("between_share"), "collect_share": top("collect_share"),
            "gc_share": top("gc_share")}


def contention_why(m: dict, median_mhz: float | None = None) -> dict:
    """What marks one run's host monitor figures (``run_host_monitor``) as a contended host: steal
    at least ``HOSTMON_STEAL`` of the time its CPUs wanted, a cgroup quota-throttled in
    ``HOSTMON_CG_THROTTLED`` of its periods or more, other processes on ``HOSTMON_OTHER_CORES`` cores
    or more, and, given the runs' median clock, cores more than ``HOSTMON_MHZ_LOW`` under it. Each
    as its figure (the clock: over the median); empty for an uncontended run."""
    why = {}
    if (m.get("steal_frac") or 0) >= HOSTMON_STEAL:
        why["steal"] = m["steal_frac"]
    if (m.get("cgroup_throttled_frac") or 0) >= HOSTMON_CG_THROTTLED:
        why["cgroup_throttled"] = m["cgroup_throttled_frac"]
    if (m.get("other_cores") or 0) >= HOSTMON_OTHER_CORES:
        why["other_cores"] = m["other_cores"]
    if median_mhz and m.get("cpu_mhz") and m["cpu_mhz"] < (1 - HOSTMON_MHZ_LOW) * median_mhz:
        why["cpu_mhz"] = m["cpu_mhz"] / median_mhz
    return why


def contention_text(why: dict) -> str:
    """A run's contention (``contention_why``, or a flag's ``why``) in words: 'steal 6% of the CPU
    time wanted; other processes on 2.1 cores'."""
    text = {"steal": lambda v: f"steal {v:.0%} of the CPU time wanted",
            "cgroup_throttled": lambda v: f"cgroup quota-throttled in {v:.0%} of periods",
            "other_cores": lambda v: f"other processes on {v:.1f} cores",
            "cpu_mhz": lambda v: f"core clock {v:.2f}x the median",
            "stopped_early": lambda v: f"sampling stopped early: {v}"}
    return "; ".join(text[k](v) for k, v in why.items())


def host_monitor_flags(rows: list[dict]) -> dict:
    """Runs whose host was contended while measured: steal at least ``HOSTMON_STEAL`` of the time
    the run's CPUs wanted, a cgroup quota-throttled in ``HOSTMON_CG_THROTTLED`` of its periods or
    more, other processes on ``HOSTMON_OTHER_CORES`` cores or more, or the cores' clock more than
    ``HOSTMON_MHZ_LOW`` under the validated runs' median; also a run whose sampling stopped early.
    Their error may be the host's. Flagged, never dropped. Named apart: runs with a thread on
    ``HOSTMON_ONE_THREAD`` of a core or more, and runs whose cgroup could not be read (their
    throttling is unknown, not absent)."""
    monitored = [r for r in rows if (r.get("host_monitor") or {}).get("available")]

    def med(key):
        vals = [key(r["host_monitor"]) for r in monitored]
        vals = [v for v in vals if v is not None]
        return float(np.median(vals)) if vals else None

    median = {"cpu_mhz": med(lambda m: m.get("cpu_mhz")), "run_cores": med(lambda m: m.get("run_cores")),
              "other_cores": med(lambda m: m.get("other_cores")), "steal_frac": med(lambda m: m.get("steal_frac")),
              "busiest_thread_core_frac": med(lambda m: (m.get("busiest_thread") or {}).get("core_frac"))}
    flagged = []
    for r in monitored:
        m = r["host_monitor"]
        why = contention_why(m, median["cpu_mhz"])
        if m.get("stopped_early"):
            why["stopped_early"] = m["stopped_early"]
        if why:
            flagged.append({"run": r["run"], "why": why})
    # A thread of the run near a full core: the run's own host work paces it there (not a
    # contended host, so named apart from the flags).
    one_thread = [{"run": r["run"], **r["host_monitor"]["busiest_thread"]} for r in monitored
                  if (r["host_monitor"].get("busiest_thread") or {}).get("core_frac", 0) >= HOSTMON_ONE_THREAD]
    cgroup_unread = [{"run": r["run"], "why": r["host_monitor"]["cgroup_error"]} for r in monitored
                     if r["host_monitor"].get("cgroup_error")]
    without = [r["host_monitor"] for r in rows if r.get("host_monitor") and not r["host_monitor"].get("available")]
    _label_runs(rows, flagged, one_thread, cgroup_unread)
    return {"runs_with_monitor": len(monitored), "runs": len(rows), "runs_without_figures": len(without),
            "why_without_figures": sorted({str(m.get("why")) for m in without}), "median": median,
            "thresholds": {"steal_frac": HOSTMON_STEAL, "cgroup_throttled_frac": HOSTMON_CG_THROTTLED,
                           "other_cores": HOSTMON_OTHER_CORES, "cpu_mhz_low": HOSTMON_MHZ_LOW,
                           "one_thread_core_frac": HOSTMON_ONE_THREAD},
            "flagged": flagged, "one_thread": one_thread, "cgroup_unread": cgroup_unread}


def host_monitor_flagged_text(flags: dict) -> str:
    """``host_monitor_flags``' flagged runs as 'run (steal 6% of the CPU time wanted; other
    processes on 2.1 cores); ...' for a report."""
    return "; ".join(f"{_run_name(f)} ({contention_text(f['why'])})" for f in flags["flagged"])


def host_monitor_text(flags: dict) -> str:
    """The report's paragraph on ``host_monitor_flags``."""
    without, only = _monitor_preamble(flags, "Host monitor", 27)
    if only:
        return only
    m = flags["median"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = (f"Host monitor (/proc and the cgroup through each run; {flags['runs_with_monitor']} of {flags['runs']} "
            f"runs have one): median cores used by the run {f(m['run_cores'], '.2f')}, its busiest thread "
            f"{f(m['busiest_thread_core_frac'], '.0%')} of a core, other processes {f(m['other_cores'], '.2f')} "
            f"cores, steal {f(m['steal_frac'], '.1%')}, core clock {f(m['cpu_mhz'], '.0f')} MHz. ")
    t = flags["thresholds"]
    rule = (f"steal {t['steal_frac']:.0%} of the CPU time wanted or more, a cgroup quota-throttled in "
            f"{t['cgroup_throttled_frac']:.0%} of its periods or more, other processes on {t['other_cores']:g} "
            f"core{'' if t['other_cores'] == 1 else 's'} or more, "
            f"or a core clock more than {t['cpu_mhz_low']:.0%} under the median")
    one = flags.get("one_thread") or []
    tail = (f" A thread of the run on {t['one_thread_core_frac']:.0%} of a core or more (its own host work paces "
            "it): " + "; ".join(f"{_run_name(o)} ({o['name']}"
                                + (f" of {o['process']}" if o.get("process") else "")  # older runs lack it
                                + f", {o['core_frac']:.0%})" for o in one) + "."
            if one else "")
    unread = flags.get("cgroup_unread") or []
    tail += (" Throttling unknown (a cgroup unread): " + "; ".join(f"{_run_name(u)} ({u['why']})"
                                                                   for u in unread) + "." if unread else "")
    tail += f" {without}" if without else ""
    if flags["flagged"]:
        return (head + f"On a contended host ({rule}; their host, not only the simulator, may explain their "
                "error): " + host_monitor_flagged_text(flags) + "." + tail)
    return head + f"No run on a contended host ({rule})." + tail


def run_jit_compiles(summary: dict) -> list[str] | None:
    """The kernels a run's engines JIT-compiled inside its measured window (``engine_jit_compiles``
    at run seconds >= 0; the warm-up's are before it), one entry per compile; None for a run that
    recorded none (before session 14, or the engine core in a process of its own)."""
    seen = [d.get("engine_jit_compiles") for d in summary.get("diagnostics", [])]
    if not seen or any(s is None for s in seen):
        return None
    return [c["kernel"] for s in seen for c in s if c.get("t_s", 0) >= 0]


def jit_flags(rows: list[dict]) -> dict:
    """Runs whose engine JIT-compiled kernels while measured: each compile stalls the steps beside
    it (session 14-15: generations of 4.3-7.3 s against ~2 s), which the simulator does not model,
    so their error may be the stall's. Flagged, never dropped."""
    seen = [r for r in rows if r.get("jit_compiles") is not None]
    flagged = [{"run": r["run"], "compiles": len(r["jit_compiles"]), "kernels": sorted(set(r["jit_compiles"]))}
               for r in seen if r["jit_compiles"]]
    _label_runs(rows, flagged)
    return {"runs_recorded": len(seen), "runs": len(rows), "flagged": flagged}


def jit_text(flags: dict) -> str:
    """``jit_flags``' flagged runs as 'run (6: kernel, kernel); ...' for a report."""
    return "; ".join(f"{_run_name(f)} ({f['compiles']}: {', '.join(f['kernels'])})" for f in flags["flagged"])


def flagged_text(flags: dict) -> str:
    """``host_flags``' flagged runs as 'run (cpu_loop_s 2.0x); ...' for a report."""
    return "; ".join(f"{_run_name(f)} ({', '.join(f'{k} {v:.1f}x' for k, v in f['slower'].items())})"
                     for f in flags["flagged"])


def unique_names(runs: list[str]) -> list[str]:
    """Each run folder by its shortest trailing path that no other run of ``runs`` shares
    (``session32/arms/X`` beside ``session33/arms/X``; the folder name alone where it is unique)."""
    parts = [Path(r).parts for r in runs]
    out = []
    for p in parts:
        n = 1
        while n < len(p) and sum(q[-n:] == p[-n:] for q in parts) > 1:
            n += 1
        out.append("/".join(p[-n:]))
    return out
