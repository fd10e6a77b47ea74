"""Cut what a device call carries into parts that fit beside the working tree.

A device call carries the tracked tree (and untracked files git does not ignore) plus the paths it
names, 64 MiB in all, counted as the files take on disk. The vLLM bundle (about 115 MiB) and a
compile cache (about 11 MB) travel in parts, one a call, back to back on a warm machine:

    python experiments/device_parts.py bundle            # re-split .device/vllm-* into parts that fit
    python experiments/device_parts.py cache FILE.tgz    # .device/cache-1 .. -N, each with its stage.sh
    python experiments/device_parts.py headroom          # what one part may weigh now
    python experiments/device_parts.py light             # leave the recorded H200 results out of the tree
    python experiments/device_parts.py whole             # put them back

``bundle`` keeps the bundle's bytes and order (the parts of .device/vllm-1, -2, ... concatenated) and
writes .device/vllm-1 .. -N again, each with the shared stage.sh and the last with ``.last``; stage
them as before (``bash .device/vllm-K/stage.sh``, carry ``[".device/vllm-K"]``). ``cache`` writes
.device/cache-1 .. -N: carry each in turn with ``bash .device/cache-K/stage.sh``; the last unpacks the
cache into ~/.cache on the machine, where ``device_session.sh`` finds it and restores nothing more.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

MIB = 1 << 20
LIMIT = 64 * MIB  # what one device call may carry with the tree
MARGIN = MIB // 4  # for .device_commit and the part's own folder and script

CACHE_STAGE = """#!/bin/bash
# Runs on the device machine: gathers this call's piece of a vLLM compile cache; once every piece is
# there, unpacks the cache into ~/.cache (device_session.sh then finds it and restores nothing).
set -euo pipefail
me=$(cd "$(dirname "$0")" && pwd)
store=/root/nodus-cache-in
mkdir -p "$store"
cp "$me"/piece_* "$store/"
[ -f "$me/.last" ] && cp "$me/.last" "$store/.last"
if [ ! -f "$store/.last" ] || [ "$(ls "$store"/piece_* | wc -l)" -lt "$(cat "$store/.last")" ]; then
  echo "staged $(ls "$store"/piece_* | wc -l) cache piece(s); carry the next one in the next call (within 30 s)"; exit 0
fi
mkdir -p ~/.cache
cat "$store"/piece_* | tar xz -C ~/.cache
ls -d ~/.cache/vllm/torch_compile_cache > /dev/null && echo "vLLM compile cache unpacked into ~/.cache"
"""


# Put before a stage script that gathers parts in a store on the machine (its ``store=`` line): parts
# of another split (an older size, or another bundle) staged there earlier, on a machine still warm,
# share the part names but not the cuts; joined with this split's they unpack corrupt (session 44:
# a stale part and ``.last`` from a 19 MiB split under a 13 MiB one). Each split writes ``.split``
# (its bytes' hash and part count) beside every part; a part of another split clears the store.
SPLIT_GUARD = """#!/bin/bash
# Parts of another split on this machine (device_parts.py) do not join with this one's: clear them.
g_me=$(cd "$(dirname "$0")" && pwd); g_store={store}
if [ -f "$g_me/.split" ] && [ "$(cat "$g_store/.split" 2>/dev/null)" != "$(cat "$g_me/.split")" ]; then
  if [ -d "$g_store" ] && [ -n "$(ls -A "$g_store")" ]; then echo "cleared $g_store: parts of another split"; fi
  rm -rf "$g_store"; mkdir -p "$g_store"; cp "$g_me/.split" "$g_store/.split"
fi
"""


def guarded(stage: str) -> str:
    """``stage`` with ``SPLIT_GUARD`` before it, on the store its ``store=`` line names; unchanged
    where it names none."""
    m = re.search(r"^store=(\S+)$", stage, re.M)
    if not m:
        return stage
    body = stage.split("\n", 1)[1] if stage.startswith("#!") else stage
    return SPLIT_GUARD.format(store=m.group(1)) + body


def tree_bytes_on_disk(root: Path) -> int:
    """Bytes on disk of the files a device call carries from ``root``: tracked, and untracked ones
    git does not ignore."""
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    total = 0
    for name in filter(None, out.decode().split("\0")):
        try:
            total += os.lstat(root / name).st_blocks * 512
        except FileNotFoundError:  # deleted in the work tree, not yet in the index
            continue
    return total


def part_bytes(tree_bytes: int, limit: int = LIMIT, margin: int = MARGIN) -> int:
    """The largest whole MiB a part may weigh beside a tree of ``tree_bytes`` on disk."""
    room = (limit - tree_bytes - margin) // MIB * MIB
    if room < MIB:
        raise SystemExit(f"device_parts: the tree takes {tree_bytes / MIB:.1f} MiB on disk, leaving "
                         f"{(limit - tree_bytes) / MIB:.2f} MiB of the {limit / MIB:.0f} MiB a call carries: "
                         "no part of 1 MiB fits; move files out of the tree first")
    return room


def split(data_files: list[Path], out_root: Path, name: str, size: int, prefix: str,
          stage: str | Path) -> list[Path]:
    """Concatenate ``data_files`` in order and write ``out_root/<name>-1 .. -N``, each one part of at most
    ``size`` bytes named ``<prefix>NN`` (numbered across all parts, so a glob sorts them) with the stage
    script beside it (behind ``SPLIT_GUARD``) and ``.split``; the last folder gets ``.last`` holding N. Earlier ``<name>-*`` folders are
    replaced only once every new part is written."""
    tmp = out_root / f".{name}-split"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    n = 0
    buf = b""
    digest = hashlib.sha256()

    def flush(chunk: bytes) -> None:
        nonlocal n
        n += 1
        digest.update(chunk)
        d = tmp / f"{name}-{n}"
        d.mkdir()
        (d / f"{prefix}{n - 1:02d}").write_bytes(chunk)

    for f in data_files:
        with open(f, "rb") as fh:
            while block := fh.read(size - len(buf)):  # fill the part, across the files' boundaries
                buf += block
                if len(buf) == size:
                    flush(buf)
                    buf = b""
    if buf:
        flush(buf)
    if n == 0:
        shutil.rmtree(tmp)
        raise SystemExit(f"device_parts: nothing to split ({', '.join(map(str, data_files)) or 'no files'})")
    if n > 100:
        shutil.rmtree(tmp)
        raise SystemExit(f"device_parts: {n} parts of {size / MIB:.0f} MiB; the names hold 100 at most")
    text = guarded(stage.read_text() if isinstance(stage, Path) else stage)
    split_id = f"{digest.hexdigest()[:16]}-{n}\n"
    for k in range(1, n + 1):
        d = tmp / f"{name}-{k}"
        (d / "stage.sh").write_text(text)
        (d / "stage.sh").chmod(0o755)
        (d / ".split").write_text(split_id)
    (tmp / f"{name}-{n}" / ".last").write_text(f"{n}\n")
    for old in out_root.glob(f"{name}-*"):
        shutil.rmtree(old)
    dirs = []
    for k in range(1, n + 1):
        dst = out_root / f"{name}-{k}"
        (tmp / f"{name}-{k}").rename(dst)
        dirs.append(dst)
    tmp.rmdir()
    return dirs


# What a device call needs of the recorded H200 results: every call's estimates seed, and the runs
# device_session.sh names (its graphs and ep modes replay them). Found in the script, not listed here.
RESULTS = "experiments/results/h200"
# The other GPUs' recorded results (session 63: the H100's 9.3 MiB took the light tree from 18.5 to
# 20.0 MiB, past what fits beside a 44 MiB part), left out the same way, and the simulator's
# validation reports (9.4 MiB in session 69, the light tree's largest part: 15.0 MiB left 0.7 MiB
# beside the 48 MiB part; no device call reads them, a profile names its report as text only).
OTHER_RESULTS = ("experiments/results/h100", "calibration/reports")
SESSION_SCRIPT = "experiments/device_session.sh"


def light_patterns(root: Path) -> list[str]:
    """The sparse-checkout patterns of a light tree: everything but ``RESULTS`` and ``OTHER_RESULTS``,
    less what ``SESSION_SCRIPT`` names under them and every day's ``estimates.json``."""
    if not (root / SESSION_SCRIPT).is_file():
        raise SystemExit(f"device_parts: no {SESSION_SCRIPT} under {root}: light needs the project's checkout")
    script = (root / SESSION_SCRIPT).read_text()
    dirs = (RESULTS, *OTHER_RESULTS)
    named = sorted({p.rstrip("/") for d in dirs for p in re.findall(re.escape(d) + r"/[\w./+-]+", script)})
    keep = [f"/{p}/" if (root / p).is_dir() else f"/{p}" for p in named]
    return ["/*", *(f"!/{d}/" for d in dirs), *(f"/{d}/*/estimates.json" for d in dirs), *keep]


def light(root: Path) -> None:
    """Leave the recorded H200 results (42.7 of the tree's 51.2 MiB in session 44), and the other
    GPUs' (``OTHER_RESULTS``), out of the work tree with a sparse checkout: they stay in git, and a
    device call carries only the files on disk (session 45: a run seeded from an excluded estimates
    file found none there). Parts of 48 MiB then
    fit, and the vLLM bundle stages in 3 calls, the compile cache riding with the last (session 45:
    two machines, 3 calls of 0.2-12 s each; 12 calls a machine in session 44). ``whole`` puts the
    results back; commit with the tree whole."""
    subprocess.run(["git", "-C", str(root), "sparse-checkout", "set", "--no-cone", "--stdin"],
                   input="\n".join(light_patterns(root)) + "\n", text=True, check=True)


def whole(root: Path) -> None:
    """Every tracked file back in the work tree (undoes ``light``)."""
    subprocess.run(["git", "-C", str(root), "sparse-checkout", "disable"], check=True)


def bundle_parts(device: Path) -> list[Path]:
    """The bundle's part files in order: the folders .device/vllm-1, -2, ... by number, each one's
    part_* by name."""
    dirs = sorted(device.glob("vllm-*"), key=lambda d: int(d.name.split("-")[1]))
    files = [f for d in dirs for f in sorted(d.glob("part_*"))]
    if not files:
        raise SystemExit(f"device_parts: no bundle parts under {device}/vllm-* (build it with "
                         "../shared/device/build_vllm_bundle.sh)")
    return files


def part_fit_hint(root: Path, tree: int, limit: int = LIMIT, margin: int = MARGIN) -> str:
    """What a light tree of ``tree`` bytes leaves the bundle's largest part (on disk): room to spare,
    or the command that re-splits it to fit (session 61: the tree grew to 19.0 MiB beside 45 MiB
    parts, over the 64 MiB a call carries, where the line had always named the re-split)."""
    parts = sorted((root / ".device").glob("vllm-*/part_*"))
    if not parts:
        return "; no bundle parts under .device/vllm-* (build them with ../shared/device/build_vllm_bundle.sh)"
    big = max(os.lstat(f).st_blocks * 512 for f in parts)
    spare = limit - tree - margin - big
    if spare < 0:
        return (f"; the bundle's largest part ({big / MIB:.1f} MiB) no longer fits beside it: re-split it with "
                "python experiments/device_parts.py bundle")
    return f"; the bundle's largest part ({big / MIB:.1f} MiB) fits beside it, {spare / MIB:.1f} MiB to spare"


def main(argv: list[str] | None = None) -> list[Path] | int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("bundle", "cache", "headroom", "light", "whole"))
    ap.add_argument("file", nargs="?", type=Path, help="cache: the compile cache (vllm-cache.tgz) a call sent back")
    ap.add_argument("--root", type=Path, default=Path("."), help="the project's checkout (default: here)")
    ap.add_argument("--part-mib", type=int, default=None, help="a part's size; default: the most that fits")
    ap.add_argument("--stage", type=Path, default=Path("../shared/device/stage.sh"),
                    help="bundle: the stage script each part carries")
    a = ap.parse_args(argv)
    root = a.root.resolve()
    if a.what in ("light", "whole"):
        (light if a.what == "light" else whole)(root)
        tree = tree_bytes_on_disk(root)
        print(f"tree {tree / MIB:.1f} MiB on disk{part_fit_hint(root, tree) if a.what == 'light' else ''}")
        return 0
    tree = tree_bytes_on_disk(root)
    size = a.part_mib * MIB if a.part_mib else min(part_bytes(tree), 48 * MIB)
    if a.part_mib and tree + size + MARGIN > LIMIT:
        raise SystemExit(f"device_parts: a {a.part_mib} MiB part beside the tree ({tree / MIB:.1f} MiB on disk) "
                         f"is over the {LIMIT // MIB} MiB a call carries")
    if a.what == "headroom":
        print(f"tree {tree / MIB:.1f} MiB on disk; a part may weigh {size // MIB} MiB")
        return size // MIB
    device = root / ".device"
    if a.what == "bundle":
        if not a.stage.is_file():
            raise SystemExit(f"device_parts: no stage script at {a.stage}")
        # The old parts are read in order; split replaces their folders only once every new part is written.
        dirs = split(bundle_parts(device), device, "vllm", size, "part_", a.stage)
    else:
        if a.file is None or not a.file.is_file():
            raise SystemExit(f"device_parts: cache needs the compile cache file a call sent back; got {a.file}")
        dirs = split([a.file], device, "cache", size, "piece_", CACHE_STAGE)
    print(f"{len(dirs)} part(s) of at most {size // MIB} MiB beside a tree of {tree / MIB:.1f} MiB on disk: "
          f"carry .device/{dirs[0].name.rsplit('-', 1)[0]}-1 .. -{len(dirs)}, one a call, "
          f"each command starting with: bash .device/{dirs[0].name.rsplit('-', 1)[0]}-K/stage.sh")
    return dirs


if __name__ == "__main__":
    main()
