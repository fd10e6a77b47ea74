"""`nodus run`: one arm through the real backend (vLLM engine + multi-LoRA trainer), or the sim.

The real backend is imported lazily (it needs torch and vLLM). Its processes are started once per
(sharing mode, stacks, engine batch settings) and reused by the arm and its dedicated baseline.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nodus.config import NO_CORUN_POLICIES, RunConfig, corun_key, engine_args_size_graphs
from nodus.outdir import make_out_dir
from nodus.runner import run_arm


class PlannedCluster:
    """A cluster ``ClusterPool.plan`` pretends to start: the settings a real one
    (``real.backend.Cluster``) keeps for the pool's decisions, and no process."""

    def __init__(self, opts, sharing: str, n_stacks: int, max_loras: int, max_cpu_loras: int | None = None, **_):
        self.opts, self.sharing, self.n_stacks, self.max_loras = opts, sharing, n_stacks, max_loras
        self.max_cpu_loras = max(max_loras, max_cpu_loras or 0)
        self.startup_s: dict[str, float] = {}
        self.trainer_restarts: list[dict] = []
        self.closed = False

    def restart_trainers(self, opts) -> None:
        self.opts = opts

    def close(self) -> None:
        self.closed = True


class ClusterPool:
    """A `make_backend(cfg, n_stacks)` over real clusters, one per ``key`` (sharing, stacks and the
    engine's batch settings), one at a time."""

    def __init__(self, opts, min_loras: int = 1, min_cpu_loras: int = 1):
        """`min_loras`: engine adapter slots to reserve, so that a cluster first asked for by a
        one-job (dedicated) run still serves the shared arms' jobs all at once; `min_cpu_loras`:
        adapters the engine keeps loaded (at least each run's jobs), so that a later, larger arm
        needs no new engine."""
        self.opts = opts
        self.min_loras = min_loras
        self.min_cpu_loras = min_cpu_loras
        self.clusters: dict[tuple, object] = {}
        self.fitted: dict[int, int] = {}  # stacks -> the default micro-batch fitted to the GPU (fit_microbatch)
        self._started: list[tuple[str, object]] = []  # every cluster started, closed ones too

    @staticmethod
    def key(cfg: RunConfig, n_stacks: int) -> tuple:
        """The cluster a run needs: its sharing mode, stacks and the engine's batch settings (fixed
        at the engine's start: a run asking others gets new processes)."""
        return cfg.arm.sharing, n_stacks, cfg.engine.max_num_seqs, cfg.engine.cuda_graph_max_tokens

    def slots(self, cfg: RunConfig) -> tuple[int, int, bool]:
        """The engine's adapter slots a run needs: (GPU slots, adapters kept loaded, exact). A config's
        engine.max_loras is its engine's, exactly (the simulator admits that many adapters a step);
        else one slot per job, or the pool's reservation if larger. Every job's current adapter
        stays loaded, also with fewer slots than jobs."""
        exact = cfg.engine.max_loras is not None
        loras = cfg.engine.max_loras if exact else max(len(cfg.jobs), self.min_loras)
        return loras, max(loras, len(cfg.jobs), self.min_cpu_loras), exact

    def _fits(self, running, cfg: RunConfig) -> bool:
        loras, cpu_loras, exact = self.slots(cfg)
        return (running is not None and running.max_cpu_loras >= cpu_loras
                and (running.max_loras == loras if exact else running.max_loras >= loras))

    def has_cluster(self, cfg: RunConfig, n_stacks: int) -> bool:
        """Whether a running cluster has the processes ``cfg`` needs, with the adapter slots it needs
        (a run that would get new processes has nothing running to reuse: ``gpu_arms`` primes it).
        The pool's ``opts`` aside: a call with other engine settings restarts the cluster anyway."""
        return self._fits(self.clusters.get(self.key(cfg, n_stacks)), cfg)

    def __call__(self, cfg: RunConfig, n_stacks: int):
        """A backend for ``cfg`` on a cluster with the pool's current ``opts``: the running one when it
        fits (also when only run-loop settings changed, ``real.backend.RUN_SETTINGS``), the running
        one with its trainers restarted when trainer settings changed (``real.backend.TRAINER_SETTINGS``:
        an A/B of trainer settings keeps the engines), else a new one."""
        from real.backend import Cluster, RealBackend, check_run_settings, fit_microbatch

        check_run_settings(cfg, self.opts)  # before any process starts
        # A default micro-batch whose graphed trainers would not fit this GPU beside the engines: the
        # largest that does, for this run's stacks (an arm and its one-stack baseline each their own).
        fitted = fit_microbatch(cfg, self.opts, n_stacks)
        if fitted is not cfg:
            self.fitted[n_stacks] = fitted.trainer.max_tokens_per_microbatch
        return RealBackend(self._cluster(fitted, n_stacks, Cluster)[0], fitted)

    def plan(self, cfg: RunConfig, n_stacks: int) -> str:
        """What a run of ``cfg`` would do to the pool's processes, decided as ``__call__`` decides and
        starting none: "start" (new processes), "restart trainers" or "reuse". The pool then holds a
        ``PlannedCluster`` where the processes would be: a pool used for planning only
        (``gpu_arms.py --plan``, ``--deadline``'s estimates)."""
        from real.backend import check_run_settings

        check_run_settings(cfg, self.opts)
        return self._cluster(cfg, n_stacks, PlannedCluster)[1]

    def shadow(self) -> "ClusterPool":
        """A pool to plan on: this one's settings, with a ``PlannedCluster`` in place of each running
        cluster (``shadow().plan(cfg, n)``: what a run would do here, touching nothing)."""
        twin = ClusterPool(self.opts, self.min_loras, self.min_cpu_loras)
        twin.clusters = {k: PlannedCluster(c.opts, c.sharing, c.n_stacks, c.max_loras, c.max_cpu_loras)
                         for k, c in self.clusters.items()}
        return twin

    def _cluster(self, cfg: RunConfig, n_stacks: int, make) -> tuple[object, str]:
        """The cluster ``cfg`` runs on (``make``: the cluster class a start constructs) and what it
        took: "start", "restart trainers" or "reuse"."""
        from real.backend import engine_settings, trainer_settings

        key = self.key(cfg, n_stacks)
        loras, cpu_loras, _ = self.slots(cfg)
        running = self.clusters.get(key)
        action = "reuse"
        if (running is not None and self.opts is not None
                and corun_key(cfg.arm.policy, cfg.arm.stacks) in NO_CORUN_POLICIES
                and running.opts.trainer_priority != self.opts.trainer_priority):
            # Engine and trainer never run at once in this run: the priority decides nothing, so
            # the running trainers keep theirs (a restart would re-prime them for nothing); the
            # run records the priority its trainers had.
            self.opts = dataclasses.replace(self.opts, trainer_priority=running.opts.trainer_priority)
        fits = self._fits(running, cfg)
        if (fits and running.opts != self.opts
                and engine_settings(running.opts) == engine_settings(self.opts)):
            if trainer_settings(running.opts) != trainer_settings(self.opts):
                running.restart_trainers(self.opts)
                action = "restart trainers"
            else:  # run-loop settings only (real.backend.RUN_SETTINGS): every process kept
                running.opts = self.opts
        elif running is not None and running.opts != self.opts:
            self.close()  # other engine settings: new processes
        if key not in self.clusters or not fits:
            # One cluster at a time holds the GPU: start the next only after the last is gone.
            # A cluster too small for this run (fewer adapter slots, or fewer kept loaded), or
            # other than the slots its config names, is restarted.
            self.close()
            cluster = self.clusters[key] = make(
                self.opts, cfg.arm.sharing, n_stacks, max_loras=loras,
                max_rank=max(j.lora_rank for j in cfg.jobs), max_num_seqs=cfg.engine.max_num_seqs,
                max_tokens_per_microbatch=cfg.trainer.max_tokens_per_microbatch, seed=cfg.seed,
                cuda_graph_max_tokens=cfg.engine.cuda_graph_max_tokens, max_cpu_loras=cpu_loras)
            self._started.append((f"{key[0]}-{key[1]}", cluster))
            action = "start"
        return self.clusters[key], action

    def startup_s(self) -> dict:
        """Each started cluster's processes' start times, keyed "sharing-stacks" (closed clusters too;
        a later cluster of the same sharing and stacks, e.g. engines sized for more jobs: "mps-2#2")."""
        out: dict = {}
        for name, c in self._started:
            n = sum(1 for k in out if k.split("#")[0] == name)
            out[name if not n else f"{name}#{n + 1}"] = c.startup_s
        return out

    def trainer_restarts(self) -> dict:
        """Per running cluster, its trainer restarts (settings and start times), when it had any."""
        return {f"{k[0]}-{k[1]}": c.trainer_restarts for k, c in self.clusters.items() if c.trainer_restarts}

    def close(self) -> None:
        for c in self.clusters.values():
            c.close()
        self.clusters.clear()


def baseline_pool(cfg: RunConfig, opts) -> ClusterPool:
    """The pool for an arm and its dedicated baseline: the arm's engine has the arm's slots (exact
    where its config sets them, as ``size_engine_slots`` does for a large overlap arm), the
    baseline's (a job at a time, ``nodus.runner.dedicated_of``) one slot per job of the arm, the
    same for every arm of the jobs."""
    return ClusterPool(opts, min_loras=len(cfg.jobs))


def record_fitted(cfg: RunConfig, summary: dict, fitted: dict[int, int]) -> RunConfig:
    """A real run's record of micro-batches fitted to its GPU (``ClusterPool.fitted``: stacks ->
    tokens): in the summary as the simulator reports them (``trainer_microbatch_fitted``), and the
    arm's in the config the run writes, so that the config says what the arm trained at and ``nodus
    validate`` replays that. ``cfg`` unchanged where nothing was fitted."""
    from nodus.runner import n_stacks as stacks_of

    if not fitted:
        return cfg
    summary["trainer_microbatch_fitted"] = {str(k): v for k, v in sorted(fitted.items())}
    arm_mb = fitted.get(stacks_of(cfg))
    if arm_mb is None:  # only the baseline's cluster was fitted
        return cfg
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"max_tokens_per_microbatch": arm_mb})})


def run(cfg: RunConfig, backend: str = "real", opts=None, out: str | Path | None = None,
        baseline: bool = True) -> dict:
    """Run one arm (and, with `baseline`, its dedicated baseline) and return the summary; write a
    run folder (config, summary, spans, trace, Gantt, learning curves) if `out`."""
    from nodus.simulate import simulate, write_run

    if backend == "sim":
        return simulate(cfg, out)
    if backend != "real":
        raise ValueError(f"--backend {backend!r}: choose real or sim")
    from real.backend import RealOptions, check_run_settings, with_audit

    cfg, opts = with_audit(cfg, opts or RealOptions())  # one audit, recorded in the run's config
    check_run_settings(cfg, opts)  # before an output folder or a process
    cfg = engine_args_size_graphs(cfg, opts.engine_args)  # graph sizes the engine args set stay theirs
    out_dir = make_out_dir(out) if out is not None else None
    if out_dir is not None and opts.adapters_out is None:  # the jobs' trained adapters: the run's deliverable
        opts = dataclasses.replace(opts, adapters_out=str(out_dir / "adapters"))
    pool = baseline_pool(cfg, opts)
    # A dedicated-GPU-per-job baseline must not share a cluster with the MPS arm's sharing mode:
    # run_arm asks the pool for a sharing='none' backend, which restarts the processes.
    try:
        summary, runs = run_arm(cfg, pool, baseline=baseline)
    finally:
        startup = pool.startup_s()
        pool.close()
    summary["backend"] = "real"
    summary["model"] = opts.model
    summary["mode"] = opts.mode
    summary["startup_s"] = startup
    cfg = record_fitted(cfg, summary, pool.fitted)
    if out_dir is not None:
        write_run(out_dir, cfg, summary, runs)
    return summary
