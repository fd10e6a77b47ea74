"""Run output folders: created fresh, never silently overwritten."""

from __future__ import annotations

import json
from pathlib import Path


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
