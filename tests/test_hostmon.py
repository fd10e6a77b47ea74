"""The host monitor (nodus.hostmon): its readers on a scripted /proc and cgroup tree, its summary
figures, this machine's own /proc while a thread burns CPU, and that it never raises."""

import os
import threading
import time
from pathlib import Path

import pytest

from nodus.hostmon import (HostMonitor, cgroup_cpu_stat_paths, parse_stat, process_tree, read_cgroup_cpu,
                           read_cpu_times, summarise)


def stat_line(pid: int, comm: str, ppid: int, ticks: int) -> str:
    """A /proc/PID/stat line whose CPU ticks are ``ticks``: utime (field 14) ``ticks - 3``, stime
    (15) 3; every other numeric field a distinct value no sum of the right fields matches."""
    fields = {4: ppid, 14: ticks - 3, 15: 3}
    rest = ["S"] + [str(fields.get(i, 1000 + 17 * i)) for i in range(4, 45)]
    return f"{pid} ({comm}) " + " ".join(rest) + "\n"


def fake_proc(root: Path, cpu=(100, 0, 50, 800, 10, 0, 0, 40), procs=None, cgroup="0::/job\n", mhz=(2000, 1800)):
    """A /proc with an aggregate cpu line, a run queue, two cores' clocks, and ``procs``: pid ->
    (comm, ppid, {tid: (thread comm, ticks)})."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text("cpu  " + " ".join(map(str, cpu)) + "\ncpu0 1 2 3 4 5 6 7 8\n"
                               "cpu1 10 20 30 40 50 60 70 80\nprocs_running 3\n")
    (root / "cpuinfo").write_text("".join(f"processor\t: {i}\ncpu MHz\t\t: {m}\n" for i, m in enumerate(mhz)))
    (root / "self").mkdir(exist_ok=True)
    (root / "self" / "cgroup").write_text(cgroup)
    for pid, (comm, ppid, threads) in (procs or {}).items():
        d = root / str(pid)
        (d / "task").mkdir(parents=True, exist_ok=True)
        (d / "stat").write_text(stat_line(pid, comm, ppid, sum(t for _, t in threads.values())))
        for tid, (tcomm, t) in threads.items():
            (d / "task" / str(tid)).mkdir(exist_ok=True)
            (d / "task" / str(tid) / "stat").write_text(stat_line(tid, tcomm, ppid, t))
    return root


def test_parse_stat_takes_fields_after_the_last_parenthesis():
    assert parse_stat(stat_line(7, "a (b) c", 3, 42)) == ("a (b) c", 3, 42)
    assert parse_stat(stat_line(7, "VLLM::EngineCore", 1, 5)) == ("VLLM::EngineCore", 1, 5)


def test_cpu_times_sum_the_runs_cpus_else_the_aggregate_line(tmp_path):
    proc = fake_proc(tmp_path / "proc")
    assert read_cpu_times(proc)["user"] == 100 and read_cpu_times(proc)["steal"] == 40
    assert read_cpu_times(proc, [1]) == dict(zip(("user", "nice", "system", "idle", "iowait", "irq", "softirq",
                                                  "steal"), (10, 20, 30, 40, 50, 60, 70, 80)))
    assert read_cpu_times(proc, [0, 1])["idle"] == 44
    assert read_cpu_times(proc, [0, 7])["user"] == 100  # a CPU /proc/stat does not list: the aggregate


def test_process_tree_is_the_root_and_its_descendants_only(tmp_path):
    proc = fake_proc(tmp_path / "proc", procs={
        10: ("python", 1, {10: ("python", 1)}), 11: ("engine", 10, {11: ("engine", 1)}),
        12: ("core", 11, {12: ("core", 1)}), 20: ("other", 1, {20: ("other", 1)})})
    assert sorted(process_tree(proc, 10)) == [10, 11, 12]
    assert process_tree(proc, 20) == [20]


def test_the_cgroup_cpu_stat_is_found_for_v2_and_v1_with_ancestors_and_read_in_seconds(tmp_path):
    proc = fake_proc(tmp_path / "proc", cgroup="0::/a/job\n")
    cg = tmp_path / "cg"
    (cg / "a" / "job").mkdir(parents=True)
    (cg / "a" / "job" / "cpu.stat").write_text(
        "usage_usec 10\nnr_periods 200\nnr_throttled 20\nthrottled_usec 1500000\n")
    (cg / "a" / "cpu.stat").write_text("usage_usec 10\nnr_periods 9\nnr_throttled 1\nthrottled_usec 0\n")
    (cg / "cpu.stat").write_text("usage_usec 10\n")  # v2's root: no throttling counters, passed over
    assert cgroup_cpu_stat_paths(proc, cg) == [cg / "a" / "job" / "cpu.stat", cg / "a" / "cpu.stat"]
    assert read_cgroup_cpu(cg / "a" / "job" / "cpu.stat") == {"nr_periods": 200, "nr_throttled": 20, "throttled_s": 1.5}
    # A leaf and root with usage lines only: nothing to read throttling from.
    only = tmp_path / "only"
    (only / "a" / "job").mkdir(parents=True)
    (only / "a" / "job" / "cpu.stat").write_text("usage_usec 10\n")
    (only / "cpu.stat").write_text("usage_usec 10\n")
    assert cgroup_cpu_stat_paths(proc, only) == []
    # v1: the cpu controller's folder, throttled_time in nanoseconds.
    proc1 = fake_proc(tmp_path / "proc1", cgroup="4:memory:/x\n2:cpu,cpuacct:/\n")
    cg1 = tmp_path / "cg1"
    (cg1 / "cpu,cpuacct").mkdir(parents=True)
    (cg1 / "cpu,cpuacct" / "cpu.stat").write_text("nr_periods 10\nnr_throttled 0\nthrottled_time 2000000000\n")
    paths1 = cgroup_cpu_stat_paths(proc1, cg1)
    assert paths1 == [cg1 / "cpu,cpuacct" / "cpu.stat"] and read_cgroup_cpu(paths1[0])["throttled_s"] == 2.0
    assert cgroup_cpu_stat_paths(fake_proc(tmp_path / "proc2", cgroup="0::/none\n"), tmp_path / "nothing") == []
    # Another process's cgroup: the pid's own file.
    (proc / "42").mkdir()
    (proc / "42" / "cgroup").write_text("0::/a\n")
    assert cgroup_cpu_stat_paths(proc, cg, 42) == [cg / "a" / "cpu.stat"]


def test_summary_figures_from_known_reads():
    """Two seconds, 100 ticks a second: 4 cores busy of which the run used 2.5; 1 core stolen."""
    a = {"user": 0, "nice": 0, "system": 0, "idle": 0, "iowait": 0, "irq": 0, "softirq": 0, "steal": 0}
    b = dict(a, user=700, system=100, idle=880, iowait=20, steal=200)  # 1900 ticks over 2 s (9.5 cores)
    samples = [(10.0, a, 2, 2000.0), (11.0, a, 6, 1900.0), (12.0, b, 4, 1800.0)]
    tree0 = ({1: 100, 2: 0}, {(1, 1): ("python", 100), (2, 2): ("engine", 0), (2, 3): ("gone", 9)})
    tree1 = ({1: 150, 2: 400, 3: 50}, {(1, 1): ("python", 150), (2, 2): ("engine", 300), (3, 3): ("new", 50)})
    cg0 = {"nr_periods": 100, "nr_throttled": 1, "throttled_s": 0.0}
    cg1 = {"nr_periods": 120, "nr_throttled": 6, "throttled_s": 0.25}
    parent = ({"nr_periods": 10, "nr_throttled": 0, "throttled_s": 0.0},
              {"nr_periods": 30, "nr_throttled": 2, "throttled_s": 0.9}, "/cg/cpu.stat")
    s = summarise(samples, tree0, tree1, [(cg0, cg1, "/cg/job/cpu.stat"), parent], hz=100, cpus=16)
    assert s["seconds"] == 2.0 and s["cpus"] == 16 and s["samples"] == 3
    assert s["cores_busy"] == pytest.approx(800 / 100 / 2)  # user + system; idle, iowait and steal are not
    # Steal against the time the CPUs wanted (busy + stolen), and in cores.
    assert s["steal_frac"] == pytest.approx(200 / 1000) and s["steal_cores"] == pytest.approx(1.0)
    assert s["iowait_frac"] == pytest.approx(20 / 1900)
    assert s["run_cores"] == pytest.approx((50 + 400 + 50) / 100 / 2) and s["run_processes"] == 3
    assert s["other_cores"] == pytest.approx(4.0 - 2.5)
    assert s["busiest_thread"] == {"name": "engine", "core_frac": pytest.approx(1.5)}
    assert s["run_queue"] == {"mean": 4.0, "max": 6} and s["cpu_mhz"] == {"mean": 1900.0, "min": 1800.0}
    # The cgroup throttled in the largest share of its periods, of the run's and its ancestors':
    # here the leaf (25% against the parent's 10%, though the parent lost more seconds) ...
    assert s["cgroup"] == {"path": "/cg/job/cpu.stat", "periods": 20, "throttled_periods": 5,
                           "throttled_frac": 0.25, "throttled_s": pytest.approx(0.25)}
    # ... a parent whose quota throttles while the leaf's counters stay at 0 ...
    idle_leaf = ({"nr_periods": 0, "nr_throttled": 0, "throttled_s": 0.0},) * 2 + ("/cg/job/cpu.stat",)
    up = summarise(samples, tree0, tree1, [idle_leaf, parent], hz=100, cpus=16)["cgroup"]
    assert up["path"] == "/cg/cpu.stat" and up["throttled_frac"] == pytest.approx(0.1)
    # ... and on a tie the leaf.
    calm = ({"nr_periods": 5, "nr_throttled": 0, "throttled_s": 0.0}, {"nr_periods": 9, "nr_throttled": 0,
                                                                     "throttled_s": 0.0})
    tie = summarise(samples, tree0, tree1, [calm + ("/leaf",), calm + ("/parent",)], hz=100, cpus=16)
    assert tie["cgroup"]["path"] == "/leaf"
    # Without the end's tree or cgroup reads: the host-wide figures only.
    bare = summarise(samples, tree0, None, None, hz=100, cpus=16)
    assert "run_cores" not in bare and "cgroup" not in bare and bare["cores_busy"] == s["cores_busy"]


def test_the_monitor_on_a_scripted_proc_and_without_one(tmp_path):
    proc = fake_proc(tmp_path / "proc", procs={10: ("python", 1, {10: ("python", 5)})})
    m = HostMonitor(interval_s=3600, root_pid=10, proc=str(proc), sys_cgroup=str(tmp_path / "none"), cpus=[]).start()
    (proc / "stat").write_text("cpu  200 0 50 900 10 0 0 40\nprocs_running 5\n")
    (proc / "10" / "stat").write_text(stat_line(10, "python", 1, 105))
    s = m.stop()
    assert s["available"] and s["samples"] == 2 and s["run_processes"] == 1 and "cgroup" not in s
    assert s["steal_frac"] == 0.0 and s["run_queue"] == {"mean": 4.0, "max": 5}
    assert m.stop() == s  # the same summary on every later call
    # The run's cgroup read at the start and gone at the end: no throttling figures, and why;
    # the rest of the summary stands.
    (proc / "10" / "cgroup").write_text("0::/job\n")
    cg = tmp_path / "cg"
    (cg / "job").mkdir(parents=True)
    (cg / "job" / "cpu.stat").write_text("nr_periods 5\nnr_throttled 0\nthrottled_usec 0\n")
    m2 = HostMonitor(interval_s=3600, root_pid=10, proc=str(proc), sys_cgroup=str(cg), cpus=[]).start()
    (cg / "job" / "cpu.stat").unlink()
    s2 = m2.stop()
    assert s2["available"] and "cgroup" not in s2 and "stopped_early" not in s2
    assert "cgroup cpu.stat unreadable at the end (FileNotFoundError" in s2["cgroup_error"]
    gone = HostMonitor(proc=str(tmp_path / "no-proc")).start().stop()
    assert gone["available"] is False and "cannot read the host's CPU state" in gone["why"]
    assert HostMonitor(proc=str(proc)).stop() == {"available": False, "why": "never started"}


def test_a_read_that_fails_mid_run_keeps_the_samples_so_far(tmp_path):
    proc = fake_proc(tmp_path / "proc", procs={10: ("python", 1, {10: ("python", 5)})})
    m = HostMonitor(interval_s=0.02, root_pid=10, proc=str(proc), sys_cgroup=str(tmp_path / "none"), cpus=[]).start()
    deadline = time.monotonic() + 10
    while len(m._samples) < 2 and time.monotonic() < deadline:  # one sample from the thread first
        time.sleep(0.02)
    (proc / "stat").unlink()
    deadline = time.monotonic() + 5
    while m._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    s = m.stop()
    assert s["available"] and s["samples"] >= 2 and "a /proc read failed after" in s["stopped_early"]
    assert "run_cores" not in s  # no end reads after the failure


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="Linux /proc")
def test_on_this_machine_a_busy_thread_shows_in_the_runs_cores():
    """A thread of this process burns 0.6 s of CPU and exits inside the window: the run's cores
    count it (a process's ticks keep its finished threads'), and nothing is left running."""
    m = HostMonitor(interval_s=0.05).start()

    def burn():
        t = time.process_time()
        while time.process_time() - t < 0.6:
            pass

    th = threading.Thread(target=burn)
    th.start()
    th.join()
    s = m.stop()
    assert s["available"] and s["seconds"] > 0.3 and s["run_processes"] >= 1
    assert s["run_cores"] * s["seconds"] >= 0.4  # at least most of the burned 0.6 CPU-seconds
    assert s["cores_busy"] > 0 and 0 <= s["steal_frac"] < 1 and s["cpus"] >= 1
    deadline = time.monotonic() + 10
    while m._thread.is_alive() and time.monotonic() < deadline:  # a loaded machine wakes it late
        time.sleep(0.05)
    assert not m._thread.is_alive()
    assert read_cpu_times(Path("/proc"))["idle"] > 0


def test_the_runs_cpus_are_read_where_proc_stat_lists_them_else_the_whole_host(tmp_path):
    """A run on CPU 1 reads cpu1's line and cpu1's clock; a run on CPUs /proc/stat does not list
    falls back to the aggregate line once, at the start, and says so."""
    proc = fake_proc(tmp_path / "proc", procs={10: ("python", 1, {10: ("python", 5)})}, mhz=(2000, 1500))
    m = HostMonitor(interval_s=3600, root_pid=10, proc=str(proc), sys_cgroup=str(tmp_path / "none"), cpus=[1]).start()
    (proc / "stat").write_text("cpu  999 0 0 0 0 0 0 0\ncpu0 900 0 0 0 0 0 0 0\n"
                               "cpu1 110 20 30 140 50 60 70 80\nprocs_running 1\n")
    s = m.stop()
    assert s["cpu_lines"] == "affinity" and s["cpus"] == 1 and s["cpu_mhz"]["mean"] == 1500.0
    # cpu1 moved by 100 user ticks and 100 idle ticks: half its time busy, whatever cpu0 did.
    assert s["cores_busy"] * s["seconds"] * os.sysconf("SC_CLK_TCK") == pytest.approx(100)
    gone = HostMonitor(interval_s=3600, root_pid=10, proc=str(proc), sys_cgroup=str(tmp_path / "none"),
                       cpus=[5, 6]).start().stop()
    assert gone["cpu_lines"] == "aggregate" and gone["available"]
    # CPU 1's line vanishing mid-run ends the sampling instead of switching to the whole host.
    m2 = HostMonitor(interval_s=3600, root_pid=10, proc=str(proc), sys_cgroup=str(tmp_path / "none"), cpus=[1]).start()
    (proc / "stat").write_text("cpu  999 0 0 0 0 0 0 0\ncpu0 900 0 0 0 0 0 0 0\n")
    s2 = m2.stop()
    assert "lists 0 of the run's 1 CPUs" in s2["stopped_early"] and s2["samples"] == 1


def test_no_thread_or_an_unreadable_cgroup_never_raises(tmp_path, monkeypatch):
    import nodus.hostmon as hostmon

    proc = fake_proc(tmp_path / "proc", procs={10: ("python", 1, {10: ("python", 5)})})
    (proc / "10" / "cgroup").write_text("0::/job\n")
    cg = tmp_path / "cg"
    (cg / "job").mkdir(parents=True)
    (cg / "job" / "cpu.stat").write_text("nr_periods 5\nnr_throttled 0\nthrottled_usec 0\n")

    def broken(path):
        raise PermissionError("denied")

    monkeypatch.setattr(hostmon, "read_cgroup_cpu", broken)
    s = HostMonitor(interval_s=3600, root_pid=10, proc=str(proc), sys_cgroup=str(cg), cpus=[]).start().stop()
    assert s["available"] and "cgroup" not in s and "cgroup cpu.stat unreadable (PermissionError" in s["cgroup_error"]
    monkeypatch.undo()

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    m = HostMonitor(interval_s=3600, root_pid=10, proc=str(proc), sys_cgroup=str(cg), cpus=[]).start()
    assert m.stop() == {"available": False, "why": "cannot start the sampling thread (can't start new thread)"}


def test_v1_cgroups_under_two_names_are_read_once_and_paths_outside_the_mount_skipped(tmp_path):
    proc = fake_proc(tmp_path / "proc", cgroup="3:cpu,cpuacct:/docker/abc\n")
    cg = tmp_path / "cg"
    (cg / "cpu,cpuacct" / "docker" / "abc").mkdir(parents=True)
    (cg / "cpu,cpuacct" / "docker" / "abc" / "cpu.stat").write_text("nr_periods 1\nnr_throttled 0\nthrottled_time 0\n")
    (cg / "cpu,cpuacct" / "docker" / "cpu.stat").write_text("nr_periods 1\nnr_throttled 0\nthrottled_time 0\n")
    (cg / "cpu").symlink_to(cg / "cpu,cpuacct")  # as v1 hosts mount it
    assert cgroup_cpu_stat_paths(proc, cg) == [cg / "cpu,cpuacct" / "docker" / "abc" / "cpu.stat",
                                               cg / "cpu,cpuacct" / "docker" / "cpu.stat"]
    outside = fake_proc(tmp_path / "proc2", cgroup="0::/../../other\n")
    (cg / "cpu.stat").write_text("nr_periods 1\nnr_throttled 0\nthrottled_usec 0\n")
    assert cgroup_cpu_stat_paths(outside, cg) == []
