"""experiments/device_parts.py: parts that fit beside the tree in one device call."""

import os
import subprocess
from pathlib import Path

import pytest

from experiments import device_parts as dp


def _repo(tmp_path, tracked_bytes=3 * dp.MIB):
    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text("/.device/\n")
    (root / "big.bin").write_bytes(os.urandom(tracked_bytes))
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    return root


def test_part_bytes_fills_the_room_in_whole_mib():
    assert dp.part_bytes(50 * dp.MIB) == 13 * dp.MIB  # 14 MiB left, less the margin, rounded down
    assert dp.part_bytes(int(57.4 * dp.MIB)) == 6 * dp.MIB
    with pytest.raises(SystemExit, match="leaving 0.50 MiB .* no part of 1 MiB fits"):
        dp.part_bytes(int(63.5 * dp.MIB))


def test_tree_counts_tracked_and_untracked_not_ignored(tmp_path):
    root = _repo(tmp_path)
    base = dp.tree_bytes_on_disk(root)
    assert base >= 3 * dp.MIB
    (root / ".device").mkdir()
    (root / ".device" / "x").write_bytes(b"0" * dp.MIB)  # ignored: not carried with the tree
    assert dp.tree_bytes_on_disk(root) == base
    (root / "new.txt").write_bytes(b"0" * dp.MIB)  # untracked, not ignored: carried
    assert dp.tree_bytes_on_disk(root) >= base + dp.MIB


def test_bundle_resplit_keeps_the_bytes_in_order(tmp_path):
    root = _repo(tmp_path)
    stage = tmp_path / "stage.sh"
    stage.write_text("#!/bin/bash\necho staged\n")
    data = os.urandom(5 * dp.MIB + 123)
    for k, (a, b) in enumerate([(0, 3 * dp.MIB), (3 * dp.MIB, len(data))], 1):  # two old parts
        d = root / ".device" / f"vllm-{k}"
        d.mkdir(parents=True)
        (d / f"part_{k - 1}").write_bytes(data[a:b])
    dirs = dp.main(["bundle", "--root", str(root), "--part-mib", "2", "--stage", str(stage)])
    assert [d.name for d in dirs] == ["vllm-1", "vllm-2", "vllm-3"]
    parts = [f for d in dirs for f in sorted(d.glob("part_*"))]
    assert [p.name for p in parts] == ["part_00", "part_01", "part_02"]
    assert b"".join(p.read_bytes() for p in parts) == data
    assert all((d / "stage.sh").read_text() == stage.read_text() for d in dirs)
    assert (dirs[-1] / ".last").read_text().strip() == "3" and not (dirs[0] / ".last").exists()
    assert sorted(p.name for p in (root / ".device").iterdir()) == ["vllm-1", "vllm-2", "vllm-3"]
    ids = {(d / ".split").read_text() for d in dirs}
    assert len(ids) == 1 and ids.pop().strip().endswith("-3")  # one split: its hash and part count


def _cache_tgz(tmp_path, mib):
    """A compile cache as a call sends it back (vllm-cache.tgz holding vllm/torch_compile_cache/blob of
    ``mib`` random MiB): the blob's path and the tgz."""
    src = tmp_path / "home" / ".cache" / "vllm" / "torch_compile_cache"
    src.mkdir(parents=True)
    (src / "blob").write_bytes(os.urandom(int(mib * dp.MIB)))
    tgz = tmp_path / "vllm-cache.tgz"
    subprocess.run(["tar", "czf", str(tgz), "-C", str(tmp_path / "home" / ".cache"), "vllm"], check=True)
    return src / "blob", tgz


def _stage_on(machine, d):
    """Run part folder ``d``'s stage script on a stand-in machine (HOME and the store under ``machine``)."""
    script = (d / "stage.sh").read_text().replace("/root/nodus-cache-in", str(machine / "cache-in"))
    (d / "stage.sh").write_text(script)
    return subprocess.run(["bash", str(d / "stage.sh")], capture_output=True, text=True, check=True,
                          env={**os.environ, "HOME": str(machine)}).stdout


def test_cache_pieces_unpack_on_the_machine(tmp_path):
    root = _repo(tmp_path)
    blob, tgz = _cache_tgz(tmp_path, 2.5)
    dirs = dp.main(["cache", str(tgz), "--root", str(root), "--part-mib", "1"])
    assert len(dirs) == 3 and [d.name for d in dirs] == ["cache-1", "cache-2", "cache-3"]
    assert b"".join(f.read_bytes() for d in dirs for f in sorted(d.glob("piece_*"))) == tgz.read_bytes()
    # The stage scripts on a stand-in machine: HOME and the store moved under tmp_path.
    home = tmp_path / "machine"
    home.mkdir()
    for k, d in enumerate(dirs, 1):
        assert ("unpacked" in _stage_on(home, d)) == (k == 3)
    assert (home / ".cache" / "vllm" / "torch_compile_cache" / "blob").read_bytes() == blob.read_bytes()


def test_a_stale_split_on_a_warm_machine_is_cleared(tmp_path):
    # Session 44: a part and .last of a 19 MiB split were on the machine when a 13 MiB split of the
    # same bytes was staged; the same part names joined across the two splits and unpacked corrupt.
    root = _repo(tmp_path)
    blob, tgz = _cache_tgz(tmp_path, 3.5)
    machine = tmp_path / "machine"
    machine.mkdir()
    old = dp.main(["cache", str(tgz), "--root", str(root), "--part-mib", "2"])  # 2 pieces
    assert len(old) == 2
    _stage_on(machine, old[-1])  # the old split's last piece and its .last (2) reach the machine
    new = dp.main(["cache", str(tgz), "--root", str(root), "--part-mib", "1"])  # 4 pieces
    assert len(new) == 4
    outs = [_stage_on(machine, d) for d in new]
    assert "another split" in outs[0] and not any("another split" in o for o in outs[1:])
    assert ["unpacked" in o for o in outs] == [False, False, False, True]
    assert (machine / ".cache" / "vllm" / "torch_compile_cache" / "blob").read_bytes() == blob.read_bytes()


def test_bad_input_is_named(tmp_path):
    root = _repo(tmp_path)
    with pytest.raises(SystemExit, match="no bundle parts under"):
        dp.main(["bundle", "--root", str(root), "--part-mib", "2", "--stage", __file__])
    with pytest.raises(SystemExit, match="cache needs the compile cache file"):
        dp.main(["cache", str(tmp_path / "missing.tgz"), "--root", str(root), "--part-mib", "1"])
    with pytest.raises(SystemExit, match="a 62 MiB part beside the tree .* is over the 64 MiB"):
        dp.main(["headroom", "--root", str(root), "--part-mib", "62"])
    with pytest.raises(SystemExit, match="no experiments/device_session.sh under .*: light needs the project's checkout"):
        dp.main(["light", "--root", str(root)])


def test_light_leaves_the_recorded_results_out_but_what_a_call_reads(tmp_path):
    """``light``: the recorded H200 and H100 results leave the work tree (they stay in git), so the tree a call
    carries shrinks and parts grow; every day's estimates seed and the runs device_session.sh names
    stay; ``whole`` puts every file back."""
    root = _repo(tmp_path, tracked_bytes=dp.MIB)
    res = root / dp.RESULTS
    (res / "s1" / "arms" / "run").mkdir(parents=True)
    (res / "s1" / "arms" / "run" / "spans.jsonl.gz").write_bytes(os.urandom(4 * dp.MIB))
    (res / "s1" / "estimates.json").write_text("{}")
    (res / "s2" / "arms" / "named").mkdir(parents=True)
    (res / "s2" / "arms" / "named" / "summary.json").write_text("{}")
    other = root / dp.OTHER_RESULTS[0]  # another GPU's results (session 63: the H100's 9.3 MiB)
    (other / "s3" / "arms" / "run").mkdir(parents=True)
    (other / "s3" / "arms" / "run" / "summary.json").write_bytes(os.urandom(2 * dp.MIB))
    reports = root / "calibration" / "reports"  # the simulator's validation reports (session 69: 9.4 MiB)
    reports.mkdir(parents=True)
    (reports / "validation-x.json").write_bytes(os.urandom(dp.MIB))
    (root / dp.SESSION_SCRIPT).write_text(f'--run "${{EP_RUN:-{dp.RESULTS}/s2/arms/named}}"\n')
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"],
                   check=True)
    before = dp.tree_bytes_on_disk(root)
    dp.main(["light", "--root", str(root)])
    assert not (res / "s1" / "arms" / "run" / "spans.jsonl.gz").exists()
    assert not (other / "s3" / "arms" / "run" / "summary.json").exists()
    assert not (reports / "validation-x.json").exists()
    assert (res / "s1" / "estimates.json").exists() and (res / "s2" / "arms" / "named" / "summary.json").exists()
    assert (root / "big.bin").exists() and (root / dp.SESSION_SCRIPT).exists()
    assert dp.tree_bytes_on_disk(root) <= before - 7 * dp.MIB
    dp.main(["whole", "--root", str(root)])
    assert (res / "s1" / "arms" / "run" / "spans.jsonl.gz").exists() and (reports / "validation-x.json").exists()
    assert (other / "s3" / "arms" / "run" / "summary.json").exists()
    assert dp.tree_bytes_on_disk(root) == before


def test_device_session_stops_at_once_where_the_bundle_is_not_installed(tmp_path):
    """Session 49: a call on a machine the device had swapped for a fresh one failed in gpu_arms on
    "No module named 'pydantic'". Every mode but trainer-memory now stops first, exit 3, naming the
    cause (here a python on which vllm does not import)."""
    root = Path(__file__).resolve().parents[1]
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text("#!/bin/sh\nexit 1\n")
    (shim / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", "experiments/device_session.sh", "arms"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "the bundle is not installed on this machine" in done.stderr
    assert "trainer-memory needs no bundle" in done.stderr


def _arms_call(tmp_path, on_gpu_arms: str, out, **env_vars):
    """``device_session.sh arms`` with a shim python whose imports succeed and which runs
    ``on_gpu_arms`` (sh) in place of gpu_arms.py, and an nvidia-smi that prints an H100."""
    root = Path(__file__).resolve().parents[1]
    shim = tmp_path / "bin"
    if not shim.exists():
        shim.mkdir()
    (shim / "python").write_text(f'#!/bin/sh\ncase "$*" in *gpu_arms.py*) {on_gpu_arms};; esac\nexit 0\n')
    (shim / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580'\n")
    for f in shim.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "OUT": str(out), "HOME": str(tmp_path / "home"),
           "ARMS_TIMEOUT": "30", **env_vars}
    for name in ("ESTIMATES_SEED", "SHRINK_TO_FIT"):
        if name not in env_vars:
            env.pop(name, None)
    return subprocess.run(["bash", "experiments/device_session.sh", "arms"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)


def test_an_arms_call_exits_with_its_runs_status(tmp_path):
    """Sessions 66-67: every arms call that ran to the end exited 2 (the closing grep of logs found
    none in $OUT, and 2 is also a missing ESTIMATES_SEED's code). It now exits with gpu_arms'
    status: 0 when its runs ran, theirs when not."""
    for rc in (0, 5):
        out = tmp_path / f"out{rc}"
        done = _arms_call(tmp_path, 'exit "$FAKE_ARMS_RC"', out, FAKE_ARMS_RC=str(rc))
        assert done.returncode == rc, done.stdout + done.stderr
        assert f"gpu_arms rc={rc}" in done.stdout and (out / "arms_runs.tgz").exists()


def test_an_arms_call_shrinks_micro_batches_to_fit_unless_asked_not_to(tmp_path):
    """Session 72: an H100 came for arms planned at the H200's 16k micro-batches, and two calls'
    runs were skipped by the memory check. gpu_arms gets --shrink-to-fit by default; SHRINK_TO_FIT=0
    keeps the skip."""
    for shrink, want in ((None, True), ("0", False), ("1", True)):
        args = tmp_path / f"args-{shrink}"
        done = _arms_call(tmp_path, 'echo "$*" > "$ARGS_FILE"', tmp_path / f"out-{shrink}", ARGS_FILE=str(args),
                          **({} if shrink is None else {"SHRINK_TO_FIT": shrink}))
        assert done.returncode == 0, done.stdout + done.stderr
        assert ("--shrink-to-fit" in args.read_text()) == want, (shrink, args.read_text())


def test_light_says_whether_the_bundles_largest_part_still_fits_beside_the_tree(tmp_path):
    """Session 61: the light tree grew from 18.2 to 19.0 MiB beside 45 MiB parts (over the 64 MiB a
    call carries) while the line printed the same re-split hint as always; now it says which."""
    root = Path(tmp_path)
    part = root / ".device" / "vllm-1" / "part_00"
    part.parent.mkdir(parents=True)
    part.write_bytes(os.urandom(40 * dp.MIB))
    assert "fits beside it" in dp.part_fit_hint(root, 20 * dp.MIB)
    assert "no longer fits beside it: re-split" in dp.part_fit_hint(root, 24 * dp.MIB)
    assert "no bundle parts" in dp.part_fit_hint(root / "elsewhere", 0)
