"""Run output folders: created fresh, never silently overwritten."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path


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
