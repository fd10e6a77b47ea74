"""Run output folders: created fresh, never silently overwritten."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

PROBE_LOOP = 1_000_000  # iterations of the probe's pure-Python loop (~0.05-0.1 s on a server core)
PROBE_FILE_MIB = 16  # the probe's file write and read back: an adapter's size in bf16 (~19 MiB)


def git_commit() -> str | None:
    """The code a run or measurement came from: $NODUS_COMMIT where the tree travelled without
    its history (the device session sets it), else git's HEAD; None outside a checkout."""
    if os.environ.get("NODUS_COMMIT"):
        return os.environ["NODUS_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def host() -> dict:
    """The machine a run or measurement ran on, beyond its GPU: its CPU model, logical cores and
    whether /dev/shm (the fast adapter publish path) exists. The real backend's phases are host-
    bound in part (launches, adapter save/load): the same GPU behind another CPU measured up to
    1.5x slower trains and 3x slower publishes (experiments/results/h200/session4)."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {"cpu": model or platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "dev_shm": os.path.isdir("/dev/shm")}


def gpu() -> dict | None:
    """The first GPU's name and total memory in GiB (nvidia-smi), or None where none can be read (a
    CPU run). A run records it so a profile fitted on its runs names the GPU they ran on (``nodus
    fit``: ``environment.gpu``, which the simulator's micro-batch fit reads, ``nodus.gpumemory``)."""
    from nodus.gpumemory import query_gpu

    got = query_gpu("name,memory.total")
    if got is None:
        return None
    name, total_mib = got
    try:
        return {"name": name, "total_gib": round(float(total_mib) / 1024, 2)}
    except ValueError:
        return {"name": name, "total_gib": None}


def machine() -> dict:
    """Which machine a run ran on, to tell two machines of one kind apart: its host name and the
    kernel's boot id. Lent GPU machines look alike (same CPU model, cores and GPU), yet runs of one
    configuration differ between them: a ratio whose dedicated run came from another machine holds
    the machines' difference too (experiments/results/h200/session34). The GPU's own UUID comes with
    the GPU monitor (``nodus.gpumon``). Either field is None where it cannot be read."""
    boot = None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip() or None
    except OSError:
        pass
    return {"hostname": platform.node() or None, "boot_id": boot}


def host_probe(scratch: str | None = None) -> dict:
    """The same small host work, timed, so runs can be told apart by the state of their host, not
    only by their results: a pure-Python loop (the launch-bound trainer and the engine's scheduler
    run on such cores), a 16 MiB file written, flushed and read back in ``scratch`` (the adapter
    publish path; default the temp folder), and the 1-minute load average (other processes). One
    H200 session measured a call whose train steps ran 1.9x and publishes 2-3x slower than an hour
    earlier on the same code (experiments/results/h200/session8); the real backend records this
    at each run's start and end. About 0.1-0.2 s."""
    t0 = time.perf_counter()
    acc = 0
    for i in range(PROBE_LOOP):
        acc += i & 7
    cpu_s = time.perf_counter() - t0
    data = b"\x5a" * (PROBE_FILE_MIB << 20)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile(dir=scratch) as f:
        f.write(data)
        f.flush()
        f.seek(0)
        while f.read(1 << 22):
            pass
    rw_s = time.perf_counter() - t0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu_loop_s": cpu_s, "file_rw_s": rw_s, "load1": load, "unix_s": time.time()}


class OutputExistsError(FileExistsError):
    """The output folder already holds files; runs never overwrite one."""


def make_out_dir(path: str | Path) -> Path:
    p = Path(path)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise OutputExistsError(f"--out {str(p)!r} already exists and is not empty; "
                                "choose a new folder (runs never overwrite one)")
    p.mkdir(parents=True, exist_ok=True)
    return p


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")
