"""The host monitor (nodus.hostmon): its readers on a scripted /proc and cgroup tree, its summary
figures, this machine's own /proc while a thread burns CPU, and that it never raises."""

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from nodus.hostmon import (HostMonitor, cgroup_cpu_stat_paths, describe_process, parse_stat, process_tree,
                           read_cgroup_cpu, read_cpu_times, summarise)


def stat_line(pid: int, comm: str, ppid: int, ticks: int) -> str:
    """A /proc/PID/stat line whose CPU ticks are ``ticks``: utime (field 14) ``ticks - 3``, stime
    (15) 3; every other numeric field a distinct value no sum of the right fields matches."""
    fields = {4: ppid, 14: ticks - 3, 15: 3}
    rest = ["S"] + [str(fields.get(i, 1000 + 17 * i)) for i in range(4, 45)]
    return f"{pid} ({comm}) " + " ".join(rest) + "\n"


def fake_proc(root: Path, cpu=(100, 0, 50, 800, 10, 0, 0, 40), procs=None, cgroup="0::/job\n", mhz=(2000, 1800)):
    """A /proc with an aggregate cpu line, a run queue, two cores' clocks, and ``procs``: pid ->
    (comm, ppid, {tid: (thread comm, ticks)}[, cmdline bytes, empty where not given])."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text("cpu  " + " ".join(map(str, cpu)) + "\ncpu0 1 2 3 4 5 6 7 8\n"
                               "cpu1 10 20 30 40 50 60 70 80\nprocs_running 3\n")
    (root / "cpuinfo").write_text("".join(f"processor\t: {i}\ncpu MHz\t\t: {m}\n" for i, m in enumerate(mhz)))
    (root / "self").mkdir(exist_ok=True)
    (root / "self" / "cgroup").write_text(cgroup)
    for pid, (comm, ppid, threads, *cmdline) in (procs or {}).items():
        d = root / str(pid)
        (d / "task").mkdir(parents=True, exist_ok=True)
        (d / "cmdline").write_bytes(cmdline[0] if cmdline else b"")
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
    assert s["busiest_thread"] == {"name": "engine", "core_frac": pytest.approx(1.5), "pid": 2, "tid": 2}
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


def test_a_process_is_described_by_its_name_and_command_line_cut_to_120_characters(tmp_path):
    proc = fake_proc(tmp_path / "proc", procs={
        10: ("pt_main_thread", 1, {10: ("pt_main_thread", 1)}, b"python\0-m\0nodus.real\0--gpu\0\0" + b"0\0"),
        11: ("kworker/0:1", 1, {11: ("kworker/0:1", 1)}),  # an empty command line: the name alone
        12: ("VLLM::EngineCore", 10, {12: ("python", 1)}, b"python\0-c\0" + b"x" * 200 + b"\0"),
        13: ("a (b)", 10, {13: ("a (b)", 1)}, b"sh\0-c\0" + b"y" * 107 + b"\0")})  # 120 exactly
    assert describe_process(proc, 10) == "pt_main_thread: python -m nodus.real --gpu 0"
    assert describe_process(proc, 11) == "kworker/0:1"
    long = describe_process(proc, 12)
    assert len(long) == 120 and long == ("VLLM::EngineCore: python -c " + "x" * 200)[:117] + "..."
    assert describe_process(proc, 13) == "a (b): sh -c " + "y" * 107 and len(describe_process(proc, 13)) == 120
    assert describe_process(proc, 99) is None  # exited: no description, no exception
    (proc / "10" / "cmdline").unlink()
    assert describe_process(proc, 10) is None


def test_the_busiest_thread_and_the_runs_top_processes_say_which_process_they_are():
    """Two seconds, 100 ticks a second: 200 ticks are one core."""
    a = dict.fromkeys(("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"), 0)
    samples = [(0.0, a, 1, None), (2.0, dict(a, user=1600, idle=1600), 1, None)]
    procs0 = {10: 100, 11: 50, 12: 1000, 13: 0, 14: 0, 15: 5, 17: 400}
    threads0 = {(10, 10): ("python", 100), (11, 11): ("pt_main", 0), (11, 12): ("loader", 0), (11, 13): ("t", 0),
                (11, 14): ("done", 50), (12, 12): ("python", 700), (12, 20): ("python", 300),
                (17, 17): ("gone", 400)}
    # 17 exits inside the window; 16 starts inside it (its ticks from 0); 11's thread 14 exits (its
    # ticks stay in 11's); 13's threads were not read at the end.
    procs1 = {10: 200, 11: 550, 12: 1300, 13: 20, 14: 10, 15: 5, 16: 60}
    threads1 = {(10, 10): ("python", 180), (10, 11): ("new", 20), (11, 11): ("pt_main", 180),
                (11, 12): ("loader", 100), (11, 13): ("t", 99), (12, 12): ("python", 883),
                (12, 20): ("python", 417), (14, 14): ("w", 10), (15, 15): ("w", 5), (16, 16): ("late", 60)}
    described = {10: "python: python -m nodus.cli run", 11: "trainer: python -m nodus.real.trainer",
                 12: "VLLM::EngineCore: python -c from multiprocessing.spawn import spawn_main", 17: "gone: x"}
    s = summarise(samples, (procs0, threads0), (procs1, threads1), None, hz=100, cpus=8, described=described)
    assert s["busiest_thread"] == {"name": "python", "core_frac": pytest.approx(0.915), "pid": 12, "tid": 12,
                                   "process": described[12]}
    assert s["run_processes"] == 7 and s["run_cores"] == pytest.approx(
        sum(v - procs0.get(k, 0) for k, v in procs1.items()) / 200)  # the existing figures stand
    top = s["processes"]
    assert [p["pid"] for p in top] == [11, 12, 10, 16, 13]  # the 5 with the most cores; 17 exited
    assert top[0] == {"pid": 11, "process": described[11], "cores": pytest.approx(2.5), "threads_over_half_core": 2,
                      "busiest_thread_core_frac": pytest.approx(0.9)}  # 0.9 and exactly 0.5; not 0.495
    assert top[1] == {"pid": 12, "process": described[12], "cores": pytest.approx(1.5), "threads_over_half_core": 2,
                      "busiest_thread_core_frac": pytest.approx(0.915)}
    assert top[2] == {"pid": 10, "process": described[10], "cores": pytest.approx(0.5), "threads_over_half_core": 0,
                      "busiest_thread_core_frac": pytest.approx(0.4)}
    assert top[3] == {"pid": 16, "cores": pytest.approx(0.3), "threads_over_half_core": 0,  # not described
                      "busiest_thread_core_frac": pytest.approx(0.3)}
    assert top[4] == {"pid": 13, "cores": pytest.approx(0.1), "threads_over_half_core": 0}  # no thread read
    # Without descriptions (an older caller): the same figures, no process text.
    bare = summarise(samples, (procs0, threads0), (procs1, threads1), None, hz=100, cpus=8)
    assert bare["busiest_thread"] == {"name": "python", "core_frac": pytest.approx(0.915), "pid": 12, "tid": 12}
    assert [p["pid"] for p in bare["processes"]] == [11, 12, 10, 16, 13]
    assert all("process" not in p for p in bare["processes"])
    assert "processes" not in summarise(samples, (procs0, threads0), None, None, hz=100, cpus=8)


def test_the_monitor_describes_processes_at_the_end_else_the_start_and_drops_one_that_exits(tmp_path):
    root = tmp_path / "proc"
    fake_proc(root, procs={10: ("python", 1, {10: ("python", 5)}, b"python\0run.py\0"),
                           11: ("trainer", 10, {11: ("trainer", 0), 12: ("loader", 0)}, b"python\0-m\0train\0"),
                           12: ("worker", 10, {13: ("worker", 0)}, b"python\0worker.py\0")})
    m = HostMonitor(interval_s=3600, root_pid=10, proc=str(root), sys_cgroup=str(tmp_path / "none"), cpus=[]).start()
    # Inside the window: the root renames itself (the end's text wins), the trainer's command line
    # becomes unreadable (the start's stands), the worker exits, a new process starts.
    shutil.rmtree(root / "12")
    fake_proc(root, cpu=(1100, 0, 50, 1800, 10, 0, 0, 40), procs={
        10: ("python", 1, {10: ("python", 25)}, b"nodus-controller\0"),
        11: ("trainer", 10, {11: ("trainer", 300), 12: ("loader", 100)}),
        14: ("engine", 10, {14: ("engine", 200)}, b"python\0-m\0engine\0")})
    (root / "11" / "cmdline").unlink()
    s = m.stop()
    assert s["available"] and "stopped_early" not in s and s["run_processes"] == 3
    assert s["busiest_thread"]["pid"] == 11 and s["busiest_thread"]["tid"] == 11
    assert s["busiest_thread"]["name"] == "trainer" and s["busiest_thread"]["process"] == "trainer: python -m train"
    top = s["processes"]
    assert [p["pid"] for p in top] == [11, 14, 10]  # 12 exited: not listed
    assert [p.get("process") for p in top] == ["trainer: python -m train", "engine: python -m engine",
                                               "python: nodus-controller"]
    ticks = [round(p["cores"] * s["seconds"] * os.sysconf("SC_CLK_TCK")) for p in top]
    assert ticks == [400, 200, 20]  # 14 from 0: it started inside the window
    assert top[0]["busiest_thread_core_frac"] == pytest.approx(s["busiest_thread"]["core_frac"])
    assert top[0]["threads_over_half_core"] == 2  # a window of milliseconds: every busy thread is over


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


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux /proc")
def test_on_this_machine_the_busiest_thread_is_the_burning_one_of_this_process():
    """A thread of this process burns 0.6 s of CPU and is still alive at the stop: it is the busiest
    thread, by its tid, and this process, by its command line, uses the most cores."""
    burned, release, tid = threading.Event(), threading.Event(), []

    def burn():
        tid.append(threading.get_native_id())
        t = time.thread_time()
        while time.thread_time() - t < 0.6:
            pass
        burned.set()
        release.wait(30)

    m = HostMonitor(interval_s=0.05).start()
    th = threading.Thread(target=burn)
    th.start()
    try:
        assert burned.wait(60)
        s = m.stop()
    finally:
        release.set()
        th.join()
    comm = Path("/proc/self/comm").read_text().strip()
    args = " ".join(a for a in Path("/proc/self/cmdline").read_bytes().decode(errors="replace").split("\0") if a)
    want = f"{comm}: {args}"
    want = want if len(want) <= 120 else want[:117] + "..."
    hot = s["busiest_thread"]
    assert hot["tid"] == tid[0] != os.getpid() and hot["pid"] == os.getpid() and hot["process"] == want
    assert hot["core_frac"] * s["seconds"] >= 0.4  # most of the burned 0.6 CPU-seconds
    top = s["processes"][0]
    assert top["pid"] == os.getpid() and top["process"] == want
    assert top["busiest_thread_core_frac"] == hot["core_frac"] and top["cores"] >= hot["core_frac"]
    assert top["threads_over_half_core"] >= (hot["core_frac"] >= 0.5)


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


def _named_child(q, done):
    from real.workers import name_process

    ok = name_process("engine0")
    q.put((ok, Path("/proc/self/comm").read_text().strip()))
    done.wait(60)


@pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="Linux /proc only")
def test_workers_name_their_process_so_the_monitor_tells_them_apart():
    """real.workers.name_process: a spawned worker's comm becomes nodus-<name>, and the host
    monitor's description of it says so (every spawned worker would otherwise read the same)."""
    import multiprocessing as mp

    from nodus.hostmon import describe_process

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_named_child, args=(q, done))
    p.start()
    try:
        ok, comm = q.get(timeout=60)
        assert ok and comm == "nodus-engine0"
        assert describe_process(Path("/proc"), p.pid).startswith("nodus-engine0: ")
    finally:
        done.set()
        p.join(60)
