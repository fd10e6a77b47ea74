"""The real backend's process pool, with stand-in clusters (no processes): one cluster per
(sharing, stacks, engine batch settings), restarted larger when a run needs more adapter slots than it has, its trainers
alone restarted when only trainer settings change."""

import dataclasses

import pytest

import real.backend
from real.backend import BackendConfigError
from nodus.config import AuditSpec, build_config
from nodus.realrun import ClusterPool, PlannedCluster


class FakeCluster(PlannedCluster):
    """A started cluster without processes: each start and trainer restart recorded."""
    started: list = []

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        FakeCluster.started.append(self)

    def restart_trainers(self, opts):
        self.trainer_restarts.append(opts)
        super().restart_trainers(opts)


def _cfg(jobs, policy="shared-sync", slots=None):
    return build_config({"jobs": [{"task": "sorting"} for _ in range(jobs)],
                         "arm": {"policy": policy, "groups": 2 if policy == "overlap" else 1, "sharing": "none"},
                         **({"engine": {"max_loras": slots}} if slots else {})})


def test_pool_reserves_slots_and_restarts_a_cluster_too_small(monkeypatch):
    monkeypatch.setattr(real.backend, "Cluster", FakeCluster)
    monkeypatch.setattr(real.backend, "RealBackend", lambda cluster, cfg: cluster)
    FakeCluster.started = []
    # Reserved for 8 jobs: a one-job run first still gets 8 slots, and the 8-job run reuses it.
    pool = ClusterPool(opts=None, min_loras=8)
    first = pool(_cfg(1), 1)
    assert first.max_loras == 8 and pool(_cfg(8), 1) is first and len(FakeCluster.started) == 1
    # Without the reservation, the one-job cluster is too small for 8 jobs: restarted with 8.
    small = ClusterPool(opts=None)
    one = small(_cfg(1), 1)
    eight = small(_cfg(8), 1)
    assert one.max_loras == 1 and one.closed and eight.max_loras == 8 and eight is not one


def test_fewer_slots_than_jobs_keep_every_jobs_adapter_loaded(monkeypatch):
    """engine.max_loras below the jobs: that many GPU slots, and every job's current adapter kept
    on the host (vLLM's cache, max_cpu_loras), so none is read from disk again; a pool reserving
    room for a larger arm's jobs (min_cpu_loras) serves it without a new engine."""
    monkeypatch.setattr(real.backend, "Cluster", FakeCluster)
    monkeypatch.setattr(real.backend, "RealBackend", lambda cluster, cfg: cluster)
    FakeCluster.started = []
    pool = ClusterPool(opts=None, min_loras=4)
    four = pool(_cfg(8, "overlap", slots=4), 1)
    assert (four.max_loras, four.max_cpu_loras) == (4, 8)
    sixteen = pool(_cfg(16, "overlap", slots=4), 1)  # 16 jobs' adapters do not fit 8 kept: a new engine
    assert four.closed and (sixteen.max_loras, sixteen.max_cpu_loras) == (4, 16)
    FakeCluster.started = []
    reserved = ClusterPool(opts=None, min_loras=8, min_cpu_loras=16)
    first = reserved(_cfg(4), 1)
    assert (first.max_loras, first.max_cpu_loras) == (8, 16)
    assert reserved(_cfg(16, "overlap", slots=8), 1) is first and len(FakeCluster.started) == 1
    # A config's slots are its engine's exactly: 4 asked of a pool running 8 get a 4-slot engine.
    assert not reserved.has_cluster(_cfg(8, "overlap", slots=4), 1)  # (gpu_arms primes a new one)
    four = reserved(_cfg(8, "overlap", slots=4), 1)
    assert first.closed and (four.max_loras, four.max_cpu_loras) == (4, 16)
    assert reserved.has_cluster(_cfg(8, "overlap", slots=4), 1) and not reserved.has_cluster(_cfg(8), 1)


def test_the_dedicated_baseline_gets_one_slot_per_job_whatever_the_arm(monkeypatch):
    """nodus run's pool: the arm's engine has the arm's slots (8, exact, for 16 jobs in 2 groups as
    size_engine_slots sizes them), its dedicated baseline's one slot per job (16) for every arm."""
    from nodus.realrun import baseline_pool
    from nodus.runner import dedicated_of

    monkeypatch.setattr(real.backend, "Cluster", FakeCluster)
    monkeypatch.setattr(real.backend, "RealBackend", lambda cluster, cfg: cluster)
    for arm, arm_slots in ((_cfg(16, "overlap", slots=8), 8), (_cfg(16), 16)):
        FakeCluster.started = []
        pool = baseline_pool(arm, None)
        assert pool(arm, 1).max_loras == arm_slots
        base = dedicated_of(arm)
        one_job = base.model_copy(update={"jobs": base.jobs[:1]})  # the baseline runs a job at a time
        assert pool(one_job, 1).max_loras == 16


def test_pool_restarts_only_the_trainers_when_only_trainer_settings_change(monkeypatch):
    from real.backend import RealOptions, engine_settings, trainer_settings

    monkeypatch.setattr(real.backend, "Cluster", FakeCluster)
    monkeypatch.setattr(real.backend, "RealBackend", lambda cluster, cfg: cluster)
    FakeCluster.started = []
    opts = RealOptions(model="tiny")
    pool = ClusterPool(opts)
    first = pool(_cfg(2), 1)
    assert pool(_cfg(2), 1) is first and first.trainer_restarts == []  # same options: nothing restarts
    graphed = dataclasses.replace(opts, trainer_graphs=True)  # (the priority: the test below)
    assert engine_settings(graphed) == engine_settings(opts)
    assert trainer_settings(graphed)["trainer_graphs"] and not trainer_settings(opts)["trainer_graphs"]
    pool.opts = graphed
    assert pool(_cfg(2), 1) is first and first.trainer_restarts == [graphed] and not first.closed
    # Settings of the run loop alone (the logprob audit's cadence): every process kept, no restart.
    audited = dataclasses.replace(graphed, audit_every=4)
    assert engine_settings(audited) == engine_settings(graphed) and trainer_settings(audited) == trainer_settings(graphed)
    pool.opts = audited
    # The run's config holds the same audit (real.backend.with_audit; a config of another is refused).
    every4 = _cfg(2).model_copy(update={"audit": AuditSpec(every=4)})
    with pytest.raises(BackendConfigError, match="audit"):
        pool(_cfg(2), 1)
    assert pool(every4, 1) is first and first.trainer_restarts == [graphed] and first.opts is audited
    # An engine setting (here the engine's thread percentage) needs new engines: a new cluster.
    pool.opts = dataclasses.replace(graphed, engine_thread_pct=60)
    other = pool(_cfg(2), 1)
    assert other is not first and first.closed and len(FakeCluster.started) == 2


def test_the_adapter_handoff_is_a_run_loop_setting_and_a_bad_one_is_refused():
    """adapter_format is named in each command to the trainers (every process kept: the engines read
    either file); an unknown format, or the flat file with vLLM's core in a process of its own (where
    nodus cannot teach vLLM's loader the format), is refused when the options are made."""
    from real.backend import RUN_SETTINGS, RealOptions, engine_settings, trainer_settings

    opts = RealOptions(model="tiny")
    # The default: flat files where the engine core runs in the engine worker's process (session 65),
    # PEFT folders where it runs in a process of vLLM's own; either asked for explicitly.
    assert opts.adapter_format == "flat"
    assert RealOptions(engine_core_process=True).adapter_format == "safetensors"
    peft = dataclasses.replace(opts, adapter_format="safetensors")
    assert peft.adapter_format == "safetensors" and RealOptions(adapter_format="flat").adapter_format == "flat"
    assert engine_settings(peft) == engine_settings(opts) and trainer_settings(peft) == trainer_settings(opts)
    assert "adapter_format" in RUN_SETTINGS
    with pytest.raises(ValueError, match="adapter_format='npz': choose one of"):
        RealOptions(adapter_format="npz")
    with pytest.raises(ValueError, match="adapter_format='flat' needs the engine core in the engine worker"):
        RealOptions(adapter_format="flat", engine_core_process=True)


def test_the_engines_batch_settings_pick_the_cluster(monkeypatch):
    """max_num_seqs and the CUDA-graph size are fixed at the engine's start: a run asking others
    gets a new cluster (the last one closed first), and has_cluster says which runs fit the running one."""
    monkeypatch.setattr(real.backend, "Cluster", FakeCluster)
    monkeypatch.setattr(real.backend, "RealBackend", lambda cluster, cfg: cluster)
    FakeCluster.started = []
    pool = ClusterPool(opts=None)
    plain = _cfg(2)
    wide = plain.model_copy(update={"engine": plain.engine.model_copy(update={"cuda_graph_max_tokens": 1024})})
    fewer = plain.model_copy(update={"engine": plain.engine.model_copy(update={"max_num_seqs": 128})})
    assert not pool.has_cluster(plain, 1)
    first = pool(plain, 1)
    assert pool.has_cluster(plain, 1) and not pool.has_cluster(wide, 1) and not pool.has_cluster(fewer, 1)
    assert not pool.has_cluster(plain, 2)  # another stack count
    second = pool(wide, 1)
    assert second is not first and first.closed and pool.has_cluster(wide, 1) and not pool.has_cluster(plain, 1)
    third = pool(fewer, 1)
    assert third is not second and second.closed and len(FakeCluster.started) == 3
    # Each start's times stay recorded, closed clusters' too, the later ones of one sharing and
    # stack count numbered (gpu_arms keeps every cluster's start in arms.json).
    first.startup_s, third.startup_s = {"engine0": 50.0}, {"engine0": 70.0}
    assert pool.startup_s() == {"none-1": {"engine0": 50.0}, "none-1#2": {}, "none-1#3": {"engine0": 70.0}}


def test_a_plan_says_what_a_run_would_do_to_the_processes_and_touches_none(monkeypatch):
    """ClusterPool.plan decides as a run does ("start", "restart trainers", "reuse") and starts
    nothing; shadow() plans on a twin of a pool with running clusters, leaving them as they are."""
    from real.backend import RealOptions

    monkeypatch.setattr(real.backend, "Cluster", FakeCluster)
    monkeypatch.setattr(real.backend, "RealBackend", lambda cluster, cfg: cluster)
    FakeCluster.started = []
    opts = RealOptions(model="tiny")
    planner = ClusterPool(opts)
    assert planner.plan(_cfg(2), 1) == "start" and planner.plan(_cfg(2), 1) == "reuse"
    assert planner.plan(_cfg(2), 2) == "start"  # another stack count: new processes
    planner.opts = dataclasses.replace(opts, trainer_graphs=True)
    assert planner.plan(_cfg(2), 2) == "restart trainers" and FakeCluster.started == []
    pool = ClusterPool(opts)
    running = pool(_cfg(2), 1)
    fewer = _cfg(2).model_copy(update={"engine": _cfg(2).engine.model_copy(update={"max_num_seqs": 128})})
    assert pool.shadow().plan(_cfg(2), 1) == "reuse" and pool.shadow().plan(fewer, 1) == "start"
    pool.opts = dataclasses.replace(opts, trainer_graphs=True)
    assert pool.shadow().plan(_cfg(2), 1) == "restart trainers"
    # The running cluster is untouched by the plans: not closed, no trainer restarted, the only one started.
    assert not running.closed and running.trainer_restarts == [] and running.opts == opts
    assert FakeCluster.started == [running] and pool(_cfg(2), 1) is running


def test_the_audit_cadence_picks_each_jobs_steps_and_a_bad_one_is_refused(capsys):
    """--audit-every N: a job's steps 0, N, 2N, ... are audited (the engine returns logprobs then
    only); --no-audit none; N < 1 is refused by name before anything starts."""
    from types import SimpleNamespace

    from nodus.cli import main
    from real.backend import RealBackend, RealOptions

    every2 = SimpleNamespace(opts=RealOptions(audit_every=2))
    assert [RealBackend.audits(every2, k) for k in range(5)] == [True, False, True, False, True]
    off = SimpleNamespace(opts=RealOptions(audit_logprobs=False))
    assert not any(RealBackend.audits(off, k) for k in range(3))
    for flag, says in (("--audit-every", "--audit-every 0"), ("--audit-responses", "--audit-responses 0")):
        assert main(["run", "--backend", "real", "--model", "tiny", "--jobs", "1", "--steps", "1", "--no-baseline",
                     "--sharing", "none", flag, "0"]) == 2
        assert says in capsys.readouterr().err


def test_the_trainer_gets_the_engines_logprobs_of_the_audited_responses_only():
    """--audit-responses K: on an audited step the train command carries, per sequence, the engine's
    logprobs of the first K responses of each prompt and None for the rest (the trainer audits
    those alone); on an unaudited step it carries none, and without the option every sequence's."""
    from types import SimpleNamespace

    from nodus.config import RunConfig
    from nodus.messages import Rollouts, Train
    from real.backend import RealBackend, RealOptions
    from real.engine import RolloutBatch

    prompt, comps = (5, 6), ((1, 2), (3,), (4, 4, 4))  # one prompt, three responses
    lps = ((-0.1, -0.2), (-0.3,), (-0.4, -0.5, -0.6))
    rb = RolloutBatch("j", 0, "j@0", (prompt,), (comps,), (lps,), None, (("length",) * 3,), 0.0, 1.0)

    def sent(opts, step):
        put = []
        b = SimpleNamespace(opts=opts, failed={}, jobs={"j": SimpleNamespace(responses_per_prompt=3)}, _pending={},
                            _local=[], _path=lambda j, v, stack: f"/x/{j}-{v}",
                            cfg=SimpleNamespace(jobs=[SimpleNamespace(responses_per_prompt=3)],
                                                trainer=SimpleNamespace(max_tokens_per_microbatch=4096,
                                                                        share_prompts=0)),
                            c=SimpleNamespace(trainers=[SimpleNamespace(put=put.append)]))
        b.audits = lambda k: RealBackend.audits(b, k)
        b.cfg.trainer_packing = lambda: RunConfig.trainer_packing(b.cfg)
        ro = Rollouts("j", step, 0, 3, 6, (2, 1, 3), 0.0, 1.0, data=(rb, [1.0, 0.0, 0.5]))
        RealBackend.train(b, Train("t", 0, 0, (ro,), (0,)))
        (cmd,) = put
        return cmd[4]  # the engine's logprobs per job, or None

    assert sent(RealOptions(), 0) == {"j": [list(x) for x in lps]}
    assert sent(RealOptions(audit_responses=1), 0) == {"j": [[-0.1, -0.2], None, None]}
    assert sent(RealOptions(audit_responses=2), 0) == {"j": [[-0.1, -0.2], [-0.3], None]}
    assert sent(RealOptions(audit_responses=1, audit_every=2), 1) is None  # step 1: not an audited step


def _hang_with_a_child(pidfile):
    import subprocess
    import time as _time

    child = subprocess.Popen(["sleep", "60"])
    with open(pidfile, "w") as f:
        f.write(str(child.pid))
    _time.sleep(60)


def test_reaping_a_hung_worker_terminates_its_children_too(tmp_path):
    """A worker that does not stop (an engine worker whose vLLM core runs in a child process) is
    terminated with its children: nothing is left holding the GPU."""
    import multiprocessing as mp
    import os
    import time

    import pytest

    psutil = pytest.importorskip("psutil")
    from real.backend import _reap

    pidfile = tmp_path / "child.pid"
    p = mp.get_context("spawn").Process(target=_hang_with_a_child, args=(str(pidfile),))
    p.start()
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = psutil.Process(int(pidfile.read_text()))
    _reap([p], wait_s=0.2, after_terminate_s=10)
    assert not p.is_alive()
    try:
        child.wait(timeout=10)
    except psutil.NoSuchProcess:
        pass
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_pool_keeps_the_trainers_priority_for_a_run_where_nothing_co_runs(monkeypatch):
    """A shared-sync (or dedicated) run asking the other trainer priority than the running
    trainers': engine and trainer never run at once there, so the pool keeps the running trainers
    (no restart, no re-priming) and the run records their priority; an overlap run at another
    priority restarts them, as any trainer setting does."""
    from real.backend import RealOptions

    monkeypatch.setattr(real.backend, "Cluster", FakeCluster)
    monkeypatch.setattr(real.backend, "RealBackend", lambda cluster, cfg: cluster)
    FakeCluster.started = []
    low = RealOptions(model="tiny", trainer_priority="below-normal")
    normal = dataclasses.replace(low, trainer_priority="normal")
    pool = ClusterPool(low)
    first = pool(_cfg(2, "overlap"), 1)
    pool.opts = normal
    assert pool(_cfg(2, "shared-sync"), 1) is first and first.trainer_restarts == []
    assert first.opts.trainer_priority == "below-normal"  # what the shared-sync run records
    pool.opts = normal
    assert pool(_cfg(2, "dedicated"), 1) is first and first.trainer_restarts == []
    pool.opts = normal
    assert pool(_cfg(2, "overlap"), 1) is first and [o.trainer_priority for o in first.trainer_restarts] == ["normal"]


def _smi(monkeypatch, free_mib, total_mib):
    import shutil
    import subprocess

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, f"{free_mib}, {total_mib}\n", ""))


def test_the_gpu_memory_check_refuses_an_engine_share_that_cannot_fit_and_warns_of_stacks(monkeypatch, capsys):
    """Before any process: an engine share above the free memory is refused; engines plus a ~65 GiB
    trainer per stack above it warn, naming the stacks (session 29: two stacks at 0.35 asked ~149 GiB
    of 139.8, and the trainers' graph captures ran out of memory)."""
    from real.backend import BackendConfigError, check_gpu_memory

    _smi(monkeypatch, 143155, 143771)  # an H200: 139.8 GiB free of 140.4
    check_gpu_memory(0.35, 1)
    assert capsys.readouterr().out == ""  # 49 + 2 + 2 + 65 GiB of 139.8
    check_gpu_memory(0.35, 2)
    out = capsys.readouterr().out
    assert "~65 GiB per trainer x 2 stacks" in out and "may not fit in 139.8 GiB free" in out and "trains eager" in out
    assert "trainer.max_tokens_per_microbatch 8192 would fit" in out
    with pytest.raises(BackendConfigError, match="need 147.4 GiB but only 139.8 GiB"):
        check_gpu_memory(1.05, 1)
    # The trainer's estimate follows its micro-batch: two stacks at 8k tokens (session 30: they fitted).
    check_gpu_memory(0.35, 2, microbatch_tokens=8192)
    assert capsys.readouterr().out == ""  # 49 + 2 x (2 + 35) + 2 GiB
    check_gpu_memory(0.35, 2, microbatch_tokens=16384)
    assert "~65 GiB per trainer x 2 stacks" in capsys.readouterr().out
    # An eager trainer keeps the flat estimate: one stack at 32k tokens does not warn, two at 8k do
    # (and no micro-batch is named: its estimate does not follow it).
    check_gpu_memory(0.35, 1, microbatch_tokens=32768, graphed=False)
    assert capsys.readouterr().out == ""
    check_gpu_memory(0.35, 2, microbatch_tokens=8192, graphed=False)
    out = capsys.readouterr().out
    assert "~50 GiB per trainer x 2 stacks" in out and "lower --engine-memory" in out


def test_the_gpu_memory_check_warns_of_the_h100_run_that_trained_eager(monkeypatch, capsys):
    """Session 49's H100 (79.2 GiB, 77.2 free): two stacks at 0.35 with 8k-token graphed trainers
    ran out of memory in both captures (one trainer at 28.3 GiB) and trained eager. The check warns
    and names the micro-batch that fits: 4096 (27.7 + 2 x (2 + 19.8) + 2 = 73.3 GiB; the trainer's 19.8
    GiB at 4096 measured there, experiments/results/h100/session49/trainer_memory.json)."""
    from real.backend import check_gpu_memory, microbatch_that_fits

    _smi(monkeypatch, 79053, 81079)
    check_gpu_memory(0.35, 2, microbatch_tokens=8192)
    out = capsys.readouterr().out
    assert "~35 GiB per trainer x 2 stacks" in out and "trainer.max_tokens_per_microbatch 4096 would fit" in out
    check_gpu_memory(0.35, 2, microbatch_tokens=4096)
    assert capsys.readouterr().out == ""
    assert microbatch_that_fits(77.2, 79.18, 0.35, 2, 8192) == 4096
    assert microbatch_that_fits(77.2, 79.18, 0.35, 1, 8192) == 8192  # one stack: 8k fits
    assert microbatch_that_fits(139.8, 140.4, 0.35, 2, 16384) == 8192  # session 30's H200 pair
    assert microbatch_that_fits(30.0, 40.0, 0.9, 2, 16384) is None  # the engines alone leave no room
    assert microbatch_that_fits(77.2, 79.18, 0.35, 2, 8192, graphed=False) is None


def test_a_default_micro_batch_is_fitted_to_the_gpu_and_a_set_one_stays(capsys):
    """A run whose config leaves the micro-batch at its default gets the largest halving whose graphed
    trainers fit beside the engines (two stacks on an 80 GB card: 4096), recorded in its config; one
    the config sets stays; runs off a GPU, eager, or where the default fits are untouched."""
    from real.backend import RealOptions, fit_microbatch

    h100, h200 = (77.2, 79.18), (139.8, 140.4)
    two = build_config({"jobs": [{"task": "sorting"} for _ in range(4)],
                        "arm": {"policy": "shared-sync", "stacks": 2, "sharing": "mps"}})
    graphed = RealOptions(device="cuda", trainer_graphs=True, engine_memory=0.35)
    fitted = fit_microbatch(two, graphed, 2, mem=h100)
    assert fitted.trainer.max_tokens_per_microbatch == 4096 and two.trainer.max_tokens_per_microbatch == 16384
    assert "trainer micro-batch 4096 tokens, not the default 16384" in capsys.readouterr().out
    assert fit_microbatch(two, graphed, 2, mem=h200).trainer.max_tokens_per_microbatch == 8192
    one = build_config({"jobs": [{"task": "sorting"} for _ in range(4)], "arm": {"policy": "shared-sync"}})
    assert fit_microbatch(one, graphed, 1, mem=h200) is one  # 49 + 2 + 2 + 65 GiB fits
    assert fit_microbatch(one, graphed, 1, mem=h100).trainer.max_tokens_per_microbatch == 8192
    capsys.readouterr()
    set_ = build_config({"jobs": [{"task": "sorting"} for _ in range(4)],
                         "arm": {"policy": "shared-sync", "stacks": 2, "sharing": "mps"},
                         "trainer": {"max_tokens_per_microbatch": 16384}})
    assert fit_microbatch(set_, graphed, 2, mem=h100) is set_
    assert fit_microbatch(two, RealOptions(device="cuda", trainer_graphs=False), 2, mem=h100) is two
    assert fit_microbatch(two, RealOptions(device="cpu", trainer_graphs=True), 2, mem=h100) is two
    assert fit_microbatch(two, None, 2, mem=h100) is two
    assert capsys.readouterr().out == ""


def test_the_pool_fits_each_run_for_its_own_stacks(monkeypatch, capsys):
    """Through the pool (what ``nodus run --backend real`` starts): on an 80 GB card a two-stack arm at
    the default micro-batch trains at 4096 tokens and its one-stack dedicated baseline at 8192, each
    the largest its own cluster fits, so the baseline is not slowed to the arm's size."""
    from nodus.runner import dedicated_of
    from real.backend import RealOptions, with_audit

    monkeypatch.setattr(real.backend, "Cluster", FakeCluster)
    monkeypatch.setattr(real.backend, "RealBackend", lambda cluster, cfg: (cluster, cfg))
    monkeypatch.setattr(real.backend, "gpu_memory_gib", lambda: (77.2, 79.18))
    arm = build_config({"jobs": [{"task": "sorting"} for _ in range(4)],
                        "arm": {"policy": "shared-sync", "stacks": 2, "sharing": "mps"}})
    arm, opts = with_audit(arm, RealOptions(device="cuda", trainer_graphs=True, engine_memory=0.35))
    pool = ClusterPool(opts)
    _, ran = pool(arm, 2)
    assert ran.trainer.max_tokens_per_microbatch == 4096
    _, base = pool(dedicated_of(arm), 1)
    assert base.trainer.max_tokens_per_microbatch == 8192
    out = capsys.readouterr().out
    assert "micro-batch 4096 tokens" in out and "micro-batch 8192 tokens" in out
    assert pool.fitted == {2: 4096, 1: 8192}
    # What the run records (nodus.realrun.run): both fits in its summary, and the arm's in its config,
    # which nodus validate replays; a config nothing was fitted for is written as it is.
    from nodus.realrun import record_fitted

    summary = {}
    written = record_fitted(arm, summary, pool.fitted)
    assert summary["trainer_microbatch_fitted"] == {"1": 8192, "2": 4096}
    assert written.trainer.max_tokens_per_microbatch == 4096 and arm.trainer.max_tokens_per_microbatch == 16384
    assert record_fitted(arm, {}, {}) is arm
    assert record_fitted(arm, {}, {1: 8192}) is arm  # only the baseline fitted: the arm ran as asked


def test_a_trainer_on_a_gpu_reports_its_memory_peaks(monkeypatch):
    """Every warm-up and train step reports the trainer's allocator memory (reserved now and at its
    peak, allocated at its peak) with its micro-batch, so runs measure what the fit check estimates;
    off a GPU, None."""
    import torch

    from real.workers import trainer_memory

    assert trainer_memory("cpu", 8192) is None
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 20 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 28.3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 26.57 * 2**30)
    assert trainer_memory("cuda", 8192) == {"mb_tokens": 8192, "reserved_gib": 20.0, "peak_reserved_gib": 28.3,
                                            "peak_allocated_gib": 26.57}
