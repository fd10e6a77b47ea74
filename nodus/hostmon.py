"""The host's CPU while a run runs, read from /proc and the run's cgroup: how many cores the run's
processes used and its busiest thread, the CPU time other processes took, the hypervisor's steal
time, the run queue, the cores' clock, and CFS quota throttling of the run's cgroup.

Why: on session 26 every run's GPU sat at its maximum SM clock with no throttle reason
(``nodus.gpumon``), yet two identical dedicated runs about 21 minutes apart measured 2344 and 1869
steps/GPU-h: generations 24% slower, train steps 18% slower and adapter publishes (host work)
2.2x slower, with the GPU running kernels less of the time: consistent with phases bound in part by
the host (kernel launches, the engine's scheduler, adapter save and load), which the host probe
(``nodus.outdir.host_probe``) times only at a run's start and end. This monitor covers the
measured window, to test that; the real backend
keeps its summary in the run's diagnostics (``host_monitor``) and ``nodus validate`` flags runs
whose host was contended.

Host-wide figures count the CPUs the run may use (its affinity), from their ``cpuN`` lines of
/proc/stat, where it lists every one of them (``cpu_lines: "affinity"``; else the aggregate line,
``"aggregate"``, chosen once at the start); in a container /proc/stat is the host's. So
``other_cores`` is the CPU time on those CPUs that the run's processes did not take: other
processes (the MPS control daemon, not a descendant of the run, among them), kernel threads,
interrupts, and the run's own children that exited inside the window (a process's time is read
from the process while it lives). The run queue is host-wide and includes the monitor's own
thread. On a VM the cores' reported clock is often fixed.

Linux only. Never raises: without /proc, ``stop()`` says why instead of giving figures; a read that
fails later ends the sampling, and the figures so far come with ``stopped_early``; a cgroup that
cannot be read leaves out the throttling figures and says why (``cgroup_error``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from nodus.monitor import SamplingMonitor

# /proc/stat's aggregate cpu line, in order (USER_HZ ticks); guest time is already in user.
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
DESCRIPTION_CHARS = 120  # a process's description (comm and command line) is cut to this length
TOP_PROCESSES = 5  # the run's processes the summary lists, the most cores first


def run_cpus() -> list[int] | None:
    """The CPUs this process may run on (its affinity), or None where the OS does not say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def read_stat(proc: Path, cpus: list[int] | None = None, strict: bool = False) -> tuple[dict[str, int], int | None]:
    """One read of /proc/stat: its ticks per field, summed over the ``cpuN`` lines of ``cpus``
    (every listed one found), else the aggregate ``cpu`` line (``strict``: a CPU of ``cpus``
    missing raises instead); and the run queue (``procs_running``, None where it is not given)."""
    want = {f"cpu{c}" for c in cpus} if cpus else None
    total, agg, found, running = dict.fromkeys(STAT_FIELDS, 0), None, 0, None
    with open(proc / "stat") as f:
        for line in f:
            if line.startswith("procs_running "):
                running = int(line.split()[1])
            if not line.startswith("cpu"):
                continue
            name, *fields = line.split()
            vals = [int(x) for x in fields[:len(STAT_FIELDS)]]
            vals += [0] * (len(STAT_FIELDS) - len(vals))
            if name == "cpu":
                agg = dict(zip(STAT_FIELDS, vals))
            elif want is not None and name in want:
                found += 1
                for k, v in zip(STAT_FIELDS, vals):
                    total[k] += v
    if want is not None and found == len(want):
        return total, running
    if want is not None and strict:
        raise ValueError(f"{proc / 'stat'} lists {found} of the run's {len(want)} CPUs")
    if agg is None:
        raise ValueError(f"no aggregate cpu line in {proc / 'stat'}")
    return agg, running


def read_cpu_times(proc: Path, cpus: list[int] | None = None, strict: bool = False) -> dict[str, int]:
    """``read_stat``'s ticks alone."""
    return read_stat(proc, cpus, strict)[0]


def read_cpu_mhz(proc: Path, cpus: list[int] | None = None) -> float | None:
    """The mean of the current clocks /proc/cpuinfo gives for ``cpus`` (each ``processor`` block's
    ``cpu MHz``; every core where ``cpus`` is empty or none of them is listed); None without any."""
    try:
        by_cpu, cur = {}, None
        with open(proc / "cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "processor":
                    cur = int(val)
                elif key == "cpu MHz":
                    by_cpu[cur] = float(val)
    except (OSError, ValueError):
        return None
    mine = [v for c, v in by_cpu.items() if cpus and c in cpus]
    mhz = mine or list(by_cpu.values())
    return float(np.mean(mhz)) if mhz else None


def parse_stat(text: str) -> tuple[str, int, int]:
    """(comm, ppid, utime + stime ticks) of a /proc/PID/stat or /proc/PID/task/TID/stat line. The
    name is in parentheses and may hold spaces or parentheses: the fields follow the last ')'."""
    comm = text[text.index("(") + 1:text.rindex(")")]
    rest = text[text.rindex(")") + 2:].split()
    return comm, int(rest[1]), int(rest[11]) + int(rest[12])  # fields 4, 14 and 15 of proc(5)


def process_tree(proc: Path, root: int) -> list[int]:
    """``root`` and every process descended from it, from the ppid of each /proc/PID/stat."""
    parent = {}
    for p in proc.iterdir():
        if not p.name.isdigit():
            continue
        try:
            parent[int(p.name)] = parse_stat((p / "stat").read_text())[1]
        except (OSError, ValueError, IndexError):
            continue  # exited while listed
    children: dict[int, list[int]] = {}
    for pid, pp in parent.items():
        children.setdefault(pp, []).append(pid)
    tree, seen, frontier = [root], {root}, [root]
    while frontier:
        kids = [k for pid in frontier for k in children.get(pid, ()) if k not in seen]
        seen.update(kids)
        tree += kids
        frontier = kids
    return tree


def process_ticks(proc: Path, pids: list[int]) -> dict[int, int]:
    """Per process of ``pids``: its CPU ticks so far, the threads that have exited included."""
    out = {}
    for pid in pids:
        try:
            out[pid] = parse_stat((proc / str(pid) / "stat").read_text())[2]
        except (OSError, ValueError, IndexError):
            continue
    return out


def describe_process(proc: Path, pid: int) -> str | None:
    """Which process ``pid`` is, in at most ``DESCRIPTION_CHARS`` characters: its name (comm) and
    its command line's arguments joined by spaces (``"VLLM::EngineCore: python -c ..."``; the name
    alone where the command line is empty, as for a kernel thread or a zombie); None where the
    process cannot be read (it exited)."""
    try:
        comm = parse_stat((proc / str(pid) / "stat").read_text())[0]
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return None
    args = " ".join(a for a in raw.decode(errors="replace").split("\0") if a)
    text = f"{comm}: {args}" if args else comm
    return text if len(text) <= DESCRIPTION_CHARS else text[:DESCRIPTION_CHARS - 3] + "..."


def describe_processes(proc: Path, pids: list[int]) -> dict[int, str]:
    """``describe_process`` of each of ``pids`` that can be read."""
    out = {}
    for pid in pids:
        text = describe_process(proc, pid)
        if text is not None:
            out[pid] = text
    return out


def thread_ticks(proc: Path, pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """Per (pid, tid) of the processes ``pids``: the thread's name and its CPU ticks so far."""
    out = {}
    for pid in pids:
        try:
            tids = list((proc / str(pid) / "task").iterdir())
        except OSError:
            continue
        for t in tids:
            try:
                comm, _, ticks = parse_stat((t / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
            out[(pid, int(t.name))] = (comm, ticks)
    return out


def cgroup_cpu_stat_paths(proc: Path, sys_cgroup: Path, pid: int | str = "self") -> list[Path]:
    """The cpu.stat files with CFS throttling counters of process ``pid``'s cgroup and each of its
    ancestors, leaf first (v2, and v1's cpu controller): a quota set on a parent throttles its
    children, whose own counters then stay at 0."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return []
    cands = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, rel = parts
        rel_parts = [x for x in rel.strip("/").split("/") if x]
        if ".." in rel_parts:  # a cgroup outside this namespace's view: not under the mount
            continue
        roots = [sys_cgroup] if ctrls == "" else (
            [sys_cgroup / d for d in dict.fromkeys((ctrls, "cpu", "cpu,cpuacct"))] if "cpu" in ctrls.split(",") else [])
        for r in roots:
            for n in range(len(rel_parts), -1, -1):  # the leaf, then each ancestor up to the mount's root
                cands.append(r.joinpath(*rel_parts[:n], "cpu.stat"))
    out, seen = [], set()
    for c in dict.fromkeys(cands):
        try:
            st = c.stat()
            text = c.read_text()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in seen:  # v1's cpu and cpu,cpuacct: one folder, two names
            continue
        seen.add((st.st_dev, st.st_ino))
        if "nr_throttled" in text:  # v2's root cpu.stat has only usage lines
            out.append(c)
    return out


def read_cgroup_cpu(path: Path) -> dict[str, float]:
    """nr_periods, nr_throttled and throttled seconds of a cpu.stat (v2 ``throttled_usec``, v1
    ``throttled_time`` in ns)."""
    kv = {}
    for line in path.read_text().splitlines():
        k, _, v = line.partition(" ")
        if v.strip().lstrip("-").isdigit():
            kv[k] = int(v)
    throttled = kv["throttled_usec"] / 1e6 if "throttled_usec" in kv else kv.get("throttled_time", 0) / 1e9
    return {"nr_periods": kv.get("nr_periods", 0), "nr_throttled": kv.get("nr_throttled", 0),
            "throttled_s": throttled}


class HostMonitor(SamplingMonitor):
    """Samples the host every ``interval_s`` in a daemon thread between `start` and `stop`: the
    run's CPUs' times, the run queue and the cores' clock (a few small /proc reads, well under
    1 ms). The run's process tree (the calling process and its descendants), its threads and its
    cgroups' throttling counters are read at the start and the stop only: their CPU time over the
    window, the busiest thread's share of one core, and which process each is (its name and command
    line, read at the stop, else at the start). A process of the tree that exits inside the window
    is not counted."""

    thread_name = "nodus-hostmon"

    def __init__(self, interval_s: float = 0.5, root_pid: int | None = None, proc: str = "/proc",
                 sys_cgroup: str = "/sys/fs/cgroup", cpus: list[int] | None = None):
        """``cpus``: the CPUs whose /proc/stat lines count (default this process's affinity; ``[]``:
        the aggregate line)."""
        super().__init__(interval_s)
        self.root_pid = root_pid or os.getpid()
        self.proc, self.sys_cgroup = Path(proc), Path(sys_cgroup)
        self._samples: list[tuple] = []  # (monotonic s, cpu times, procs_running, MHz)
        self._cpus = run_cpus() if cpus is None else list(cpus)
        self._cg_paths: list[Path] = []
        self._cg0: dict[Path, dict] = {}
        self._cg_error: str | None = None

    def _tree(self) -> tuple[dict, dict, dict]:
        """The tree's per-process ticks, per-thread names and ticks, and process descriptions."""
        pids = process_tree(self.proc, self.root_pid)
        return process_ticks(self.proc, pids), thread_ticks(self.proc, pids), describe_processes(self.proc, pids)

    def _sample(self) -> None:
        times, running = read_stat(self.proc, self._cpus, strict=True)
        row = (time.monotonic(), times, running, read_cpu_mhz(self.proc, self._cpus))
        with self._lock:
            self._samples.append(row)

    def _begin(self) -> None:
        """Which /proc/stat lines count (chosen once, here), a first sample and the tree's start
        read; then the cgroups' counters, whose failure leaves out the throttling figures alone."""
        try:
            if self._cpus:  # the run's CPUs' lines where /proc/stat lists them all, else the aggregate
                try:
                    read_cpu_times(self.proc, self._cpus, strict=True)
                except ValueError:
                    self._cpus = []
            self._sample()
            self._tree0 = self._tree()
        except Exception as e:  # noqa: BLE001 - no /proc (not Linux), an unreadable file
            self._why = f"cannot read the host's CPU state ({type(e).__name__}: {e})"
            return
        try:  # the throttling figures alone depend on it: a failure leaves them out, and says why
            self._cg_paths = cgroup_cpu_stat_paths(self.proc, self.sys_cgroup, self.root_pid)
            self._cg0 = {p: read_cgroup_cpu(p) for p in self._cg_paths}
        except Exception as e:  # noqa: BLE001
            self._cg_paths, self._cg_error = [], f"cgroup cpu.stat unreadable ({type(e).__name__}: {e})"

    def _failure(self, e: Exception) -> str:
        return f"a /proc read failed after {len(self._samples)} samples ({type(e).__name__}: {e})"

    def _summary(self) -> dict:
        """With the end's reads (a last sample, the tree, the cgroups): the window's seconds,
        ``cpus`` (the run's CPUs, or the host's logical cores where /proc/stat is read whole:
        ``cpu_lines``); ``cores_busy`` (everything on those CPUs), ``run_cores`` (the run's process
        tree), ``other_cores`` (the difference), ``steal_cores``, each in cores over the window;
        ``steal_frac`` (of the time the CPUs wanted: busy + stolen) and ``iowait_frac`` (of all
        their time); the busiest thread (name, share of one core, pid, tid, its process) and the
        run's processes using the most cores (``summarise``); the run queue (mean, max); the
        clock (mean, min MHz); the quota throttling of the cgroup, of the run's and its ancestors',
        throttled in the largest share of its periods (its cpu.stat path, periods, throttled
        periods, their share, seconds); ``cgroup_error`` where a cgroup could not be read, and
        ``stopped_early`` where sampling ended before the stop."""
        ends = {}
        if not self._stopped:
            try:
                self._sample()
                ends["tree"] = self._tree()
            except Exception as e:  # noqa: BLE001 - the end reads failed: the window's samples stand
                self._stopped = f"the end's /proc reads failed ({type(e).__name__}: {e})"
        cg = None
        if self._cg_paths:
            try:
                cg = [(self._cg0[p], read_cgroup_cpu(p), str(p)) for p in self._cg_paths]
            except Exception as e:  # noqa: BLE001
                self._cg_error = f"cgroup cpu.stat unreadable at the end ({type(e).__name__}: {e})"
        with self._lock:
            samples = list(self._samples)
        cpus = len(self._cpus) if self._cpus else (os.cpu_count() or 1)
        tree1 = ends.get("tree")
        described = {**self._tree0[2], **(tree1[2] if tree1 else {})}  # the end's where the process still lives
        out = summarise(samples, self._tree0[:2], tree1[:2] if tree1 else None, cg,
                        os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100, cpus, described)
        out["cpu_lines"] = "affinity" if self._cpus else "aggregate"
        out["interval_s"] = self.interval_s
        if self._cg_error:
            out["cgroup_error"] = self._cg_error
        if self._stopped:
            out["stopped_early"] = self._stopped
        return out


def summarise(samples: list[tuple], tree0: tuple[dict, dict], tree1: tuple[dict, dict] | None,
              cgroups: list[tuple[dict, dict, str]] | None, hz: int, cpus: int,
              described: dict[int, str] | None = None) -> dict:
    """The summary `HostMonitor.stop` returns, from its samples and its start and end reads (each
    tree read: per-process ticks, per-thread names and ticks; per cgroup of the run and its
    ancestors, leaf first, its counters at the start and the end and its cpu.stat path: the one
    throttled in the largest share of its periods is reported, the leaf on a tie) and
    ``described``, pid -> its process's description (``describe_process``).

    The run's processes and threads are those of the end's read; one not in the start's counts its
    ticks from 0 (it started inside the window), one gone by the end is not counted. From them:
    ``busiest_thread`` (name, share of one core, pid, tid, and ``process`` where described), and
    ``processes``, the ``TOP_PROCESSES`` using the most cores: each one's pid, ``process`` (where
    described), cores (its ticks, its exited threads' included), its living threads on half a core
    or more (``threads_over_half_core``) and its busiest one's share of a core
    (``busiest_thread_core_frac``, left out where none of its threads was read)."""
    (ta, ca, _, _), (tb, cb, _, _) = samples[0], samples[-1]
    seconds = tb - ta
    total = sum(cb.values()) - sum(ca.values())
    out: dict = {"available": True, "seconds": seconds, "samples": len(samples), "cpus": cpus}
    if seconds <= 0 or total <= 0:
        return out
    steal = cb["steal"] - ca["steal"]
    busy = total - (cb["idle"] - ca["idle"]) - (cb["iowait"] - ca["iowait"]) - steal
    out["cores_busy"] = busy / hz / seconds
    # Steal against the time the CPUs wanted to run (busy + stolen), not against idle time too:
    # one thread losing a fifth of its core on an idle 16-core VM is 20%, not 1.25%.
    out["steal_frac"] = steal / (busy + steal) if busy + steal > 0 else 0.0
    out["steal_cores"] = steal / hz / seconds
    out["iowait_frac"] = (cb["iowait"] - ca["iowait"]) / total
    if tree1 is not None:
        (procs0, threads0), (procs1, threads1) = tree0, tree1
        out["run_cores"] = sum(t - procs0.get(pid, 0) for pid, t in procs1.items()) / hz / seconds
        out["run_processes"] = len(procs1)
        out["other_cores"] = max(0.0, out["cores_busy"] - out["run_cores"])
        described = described or {}
        frac = {k: (t - threads0.get(k, (None, 0))[1]) / hz / seconds for k, (_, t) in threads1.items()}
        # Ties go to the greater name, then the first read.
        hot = max(frac, key=lambda k: (frac[k], threads1[k][0]), default=None)
        if hot is not None:
            out["busiest_thread"] = {"name": threads1[hot][0], "core_frac": frac[hot], "pid": hot[0], "tid": hot[1],
                                     **({"process": described[hot[0]]} if hot[0] in described else {})}
        by_pid: dict[int, list[float]] = {}
        for (pid, _), f in frac.items():
            by_pid.setdefault(pid, []).append(f)
        rows = []
        for pid, t in procs1.items():
            mine = by_pid.get(pid, [])
            rows.append({"pid": pid, **({"process": described[pid]} if pid in described else {}),
                         "cores": (t - procs0.get(pid, 0)) / hz / seconds,
                         "threads_over_half_core": sum(f >= 0.5 for f in mine),
                         **({"busiest_thread_core_frac": max(mine)} if mine else {})})
        out["processes"] = sorted(rows, key=lambda r: -r["cores"])[:TOP_PROCESSES]
    running = [s[2] for s in samples if s[2] is not None]
    if running:
        out["run_queue"] = {"mean": float(np.mean(running)), "max": int(max(running))}
    mhz = [s[3] for s in samples if s[3] is not None]
    if mhz:
        out["cpu_mhz"] = {"mean": float(np.mean(mhz)), "min": float(min(mhz))}
    if cgroups:
        rows = []
        for cg0, cg1, path in cgroups:
            periods = cg1["nr_periods"] - cg0["nr_periods"]
            throttled = cg1["nr_throttled"] - cg0["nr_throttled"]
            rows.append({"path": path, "periods": periods, "throttled_periods": throttled,
                         "throttled_frac": throttled / periods if periods > 0 else 0.0,
                         "throttled_s": cg1["throttled_s"] - cg0["throttled_s"]})
        out["cgroup"] = max(rows, key=lambda r: r["throttled_frac"])  # max keeps the first: the leaf on a tie
    return out
