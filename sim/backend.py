"""The SimPy backend: the backend protocol over a simulated GPU, engine(s) and trainer(s).

Response lengths are drawn per job and step from a stream seeded by (job seed, step), so the
same config and seed give a byte-identical timeline whatever the arm's order of events.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import simpy

from nodus.config import (DEFAULT_PROFILES, STACKS_PROFILE, STACKS_PROTOCOL_PROFILE, STACKS_TRAINER_PROFILE, ConfigError,
                          JobSpec, RunConfig, engine_graph_max_tokens)
from nodus.lengths import prompt_tokens, sample_response_tokens
from nodus.microbatch import microbatch_costs, packed_pairs_per_microbatch, step_rows
from nodus.messages import (
    Generate, GenerateDone, JobUpdate, Publish, PublishDone, Result, Rollouts, Train, TrainDone,
)
from sim.engine import SimEngine
from sim.gpu import SharedGPU
from sim.profile import CostModel


def _note_fitted_elsewhere(cost: CostModel, n_stacks: int, mine: dict, fitted: dict, rate: str, where: str) -> None:
    """Flag a stacks arm whose settings (``mine``: policy, packing) differ from those ``rate`` was
    fitted under (``fitted``, the profile's ``where``)."""
    differ = {k: (v, fitted[k]) for k, v in mine.items() if k in fitted and fitted[k] != v}
    if differ:
        cost.note_unmodelled(
            f"arm.stacks={n_stacks}: {rate} was fitted on runs of "
            + ", ".join(f"{k}={w}" for k, (_, w) in differ.items()) + ", not "
            + ", ".join(f"{k}={v}" for k, (v, _) in differ.items()) + f" ({where})")


class SimBackend:
    def __init__(self, cfg: RunConfig, cost: CostModel, n_stacks: int = 1):
        if cfg.trainer.share_prompts > 1 and cost.profile.train.step_mode == "eager":
            # The real backend runs it with the graphed trainer only (real.backend.check_run_settings).
            raise ConfigError(f"trainer.share_prompts={cfg.trainer.share_prompts} runs on the graphed trainer only, "
                              f"and this profile's train terms describe the eager one (train.step_mode): simulate it "
                              f"on a graphed profile, e.g. --profile {DEFAULT_PROFILES['graphed']} (one stack) or "
                              f"{STACKS_PROFILE} (stacks under MPS); `nodus profiles` lists them, the H100's too")
        self.cfg, self.cost = cfg, cost
        self.env = simpy.Environment()
        sharing = cost.profile.sharing
        if cfg.arm.policy == "timeslice" and (sharing.mps_engines is not None or sharing.engines_by_batch):
            # timeslice's stacks are its groups: the two-engine rate was fitted (and its shape measured)
            # for arm.stacks arms only.
            sharing = sharing.model_copy(update={"mps_engines": None, "engines_by_batch": []})
        if (n_stacks < 2 or cfg.arm.policy == "timeslice") and (sharing.mps_stacks_trainer is not None
                                                                 or sharing.mps_trainers is not None):
            # The lone trainer's rate beside engines and the trainers' together were fitted on
            # arm.stacks arms only: one stack keeps the pair's rates its own runs were fitted on.
            sharing = sharing.model_copy(update={"mps_stacks_trainer": None, "mps_stacks_engine": None,
                                                 "mps_trainers": None})
        self.gpu = SharedGPU(self.env, cfg.arm.sharing, sharing)
        # Engines of stacks priced by the stacks' fitted rates: the most sequences an engine of their
        # fit runs generated at once, past which a generation is flagged (None: no such rate in use).
        stacks_rated = n_stacks > 1 and cfg.arm.sharing == "mps" and (
            sharing.mps_engines is not None or sharing.mps_stacks_trainer is not None or sharing.mps_trainers is not None)
        self._stacks_fit_seqs = sharing.stacks_engine_sequences if stacks_rated else None
        # The two-engine bench's largest engine for this mode, where the bench prices the engines of
        # these stacks (sim.gpu.engines_rate): the two-engine rate follows engine size up to it.
        bench = [e.batch for e in sharing.engines_by_batch if getattr(e, cfg.arm.sharing, None) is not None]
        self._bench_seqs = max(bench) if bench and n_stacks > 1 else None  # timeslice's dropped above
        # ... and its largest engine beside the other stack's trainer, where an engine and a lone trainer
        # beside each other follow it (sim.gpu.stacks_engine_rate, stacks_trainer_rate: MPS, with that
        # trainer's rate fitted).
        by_trainer = [e.batch for e in sharing.engines_by_batch if e.mps_beside_trainer is not None]
        self._bench_trainer_seqs = (max(by_trainer) if by_trainer and n_stacks > 1 and cfg.arm.sharing == "mps"
                                    and sharing.mps_stacks_trainer is not None else None)
        self._two_trainers = sharing.mps_trainers is not None  # a fitted rate, held at the fit's engine size
        self._past_fit = self._past_fit_note()  # what a generation past the fit's engine size is priced by
        self.jobs: dict[str, JobSpec] = {j.id: j for j in cfg.jobs}
        self._share = share = cfg.trainer_packing()  # the packing the real trainer runs
        if share:
            cost.note_unmodelled(
                f"trainer.share_prompts={share}: packed rows' masked attention priced from the trainer alone "
                "(train.packed_pair_per_token); beside a generation the packed step came out short (shipped H200 "
                "profiles against session 20's runs: 14-22% at 8 jobs, 16% at 16, the below-normal trainer)"
                if cost.has_packed_attention else
                f"trainer.share_prompts={share}: packed rows priced at the plain rows' per-token train cost, "
                "their masked attention unmodelled (no train.packed_pair_per_token in the profile): train steps "
                "predicted short (README, trainer.share_prompts)")
        # A two-engine rate: fitted (MPS), or the bench's for the arm's mode (sim.gpu.engines_rate).
        has_engines_rate = ((cfg.arm.sharing == "mps" and cost.profile.sharing.mps_engines is not None)
                            or self._bench_seqs is not None)
        if n_stacks > 1 and cfg.arm.policy != "timeslice":
            shared = ("engines of several stacks generating at once are priced as more clients of one GPU, sharing "
                      "the engine-trainer pair's combined rate (sim.gpu.sharing_rates), and each engine's own host "
                      "thread is not modelled")
            if cfg.arm.sharing != "mps" and self._bench_seqs is not None:
                cost.note_unmodelled(f"arm.stacks={n_stacks} without MPS: each engine generating beside another "
                                     "priced by the two-engine bench's time-sliced slowdown (sharing.engines_by_batch); "
                                     "beside a trainer too, slowed as one engine is; the trainers share the pair's "
                                     "combined rate (sim.gpu.sharing_rates)")
            elif cfg.arm.sharing != "mps":
                cost.note_unmodelled(f"arm.stacks={n_stacks} without MPS: {shared}")
            elif not has_engines_rate:
                cost.note_unmodelled(f"arm.stacks={n_stacks}: {shared}; the profile has no two-engine rate "
                                     "(sharing.mps_engines: nodus fit-stacks on two-stack runs under MPS; the "
                                     f"shipped {STACKS_PROFILE} has one)")
            else:
                if n_stacks > 2:
                    cost.note_unmodelled(
                        f"arm.stacks={n_stacks}: each of {n_stacks} engines priced at the profile's two-engine rate "
                        "(sharing.mps_engines), fitted on two (H200, session 37: three stacks of 8 jobs priced 6-8% "
                        "below the measured runs, as the same hour's two-stack runs were, 9%)")
                fitted = cost.profile.sharing.engines_controls
                mine = {"policy": cfg.arm.policy, "share_prompts": self._share}
                # A rate fitted to phase times (fit-stacks --rate phases) is not an average over the
                # runs' alignment, and its runs may mix alignments.
                by_phases = ((cost.profile.measurements or {}).get("stacks") or {}).get("fitted_on") == "phases"
                if (cfg.arm.lockstep != bool(fitted.get("lockstep")) and not by_phases
                        and cost.profile.sharing.mps_engines is not None):
                    cost.note_unmodelled(
                        f"arm.lockstep={cfg.arm.lockstep}: the two-engine rate (sharing.mps_engines) was fitted on "
                        + ("stacks in lockstep" if fitted.get("lockstep") else "free-running stacks")
                        + " (sharing.engines_controls); the rate is an average over how the runs' stacks lined up")
                trainer_fit = cost.profile.sharing.stacks_trainer_controls
                if cost.profile.sharing.mps_stacks_trainer is not None:
                    # Its policy and packing (offset or free stacks alike: a train beside another
                    # stack's generation is the case it prices whichever way the stacks started).
                    _note_fitted_elsewhere(cost, n_stacks, mine, trainer_fit,
                                           "a lone trainer's rate beside engines (sharing.mps_stacks_trainer)",
                                           "sharing.stacks_trainer_controls")
                elif cfg.arm.offset_stacks or cfg.arm.policy == "overlap":
                    what = "arm.offset_stacks" if cfg.arm.offset_stacks else f"overlap on {n_stacks} stacks"
                    cost.note_unmodelled(
                        f"{what}: a train beside a generation is priced at the pair's trainer rate "
                        "(sharing.mps_corun), fitted on one stack, and the profile has no lone-trainer rate for "
                        "stacks (sharing.mps_stacks_trainer, nodus fit-stacks --rate trainer); on the H200 this "
                        "priced offset stacks' trains at 1.52-1.58 s against 0.88-0.96 s and their steps/GPU-h "
                        "16-17% low, overlap on two stacks 7-14% low (session 39; "
                        f"{STACKS_TRAINER_PROFILE} has the rate)")
                _note_fitted_elsewhere(cost, n_stacks, mine, fitted, "the two-engine rate (sharing.mps_engines)",
                                       "sharing.engines_controls")
                if cost.profile.sharing.mps_trainers is None and not cfg.arm.hold_apart:
                    # Stacks held apart never train at once; any other arrangement may (lockstep: every step).
                    cost.note_unmodelled(
                        f"arm.stacks={n_stacks}: trainers of stacks training at once are priced by the many-clients "
                        "rule (the engine-and-trainer pair's combined rate split over them): the profile has no "
                        "two-trainer rate (sharing.mps_trainers; nodus fit-stacks --rate phases fits it, "
                        f"{STACKS_PROTOCOL_PROFILE} has one); the rule priced lockstep train steps 20% short on "
                        "the H100 and 7% on the H200 (session 57)")
        kl = [j.id or j.task for j in cfg.jobs if j.beta]
        if kl and cost.profile.train.kl_share is None:
            cost.note_unmodelled(
                f"jobs[].beta > 0 ({', '.join(map(str, kl))}): the trainer's forward pass of the base model for "
                "the KL term is not priced (the profile has no train.kl_share; nodus calibrate measures "
                "it): those jobs' train steps are priced as without it")
        max_loras = cfg.engine.max_loras or len(cfg.jobs)
        if not cfg.audit.is_full() and not cost.profile.decode.logprob_s_per_seq:
            cost.note_unmodelled(
                f"audit={cfg.audit.words()}: the profile has no logprob term (decode.logprob_s_per_seq; "
                "`nodus fit-audit` on runs that differ in their audit alone): priced as the full audit, every "
                "response of every step returning logprobs (on the H200 one response a prompt ran 13-15% faster, "
                "session 32)")
        self.engines = [SimEngine(self.env, self.gpu, cost, cfg.engine.max_num_seqs, max_loras,
                                  self._generated, graph_max_tokens=engine_graph_max_tokens(cfg.engine),
                                  audit=cfg.audit)
                        for _ in range(n_stacks)]
        self._done: deque[Result] = deque()
        self._signal = self.env.event()
        self._lengths: dict[str, list[int]] = {}

    # -- protocol ---------------------------------------------------------------------------
    def now(self) -> float:
        return self.env.now

    def _past_fit_note(self) -> str:
        """How the rates of an engine of stacks larger than their fit's are priced: which follow the
        two-engine bench over engine size, which keep the size they were fitted at."""
        two_engines, two_trainers = ("the two-engine rate", False), ("the two trainers' rate", False)
        lone = ("the rates of a lone trainer and an engine beside it", True)  # (subject, plural)
        follows = [w for w, seen in ((two_engines, self._bench_seqs), (lone, self._bench_trainer_seqs)) if seen]
        if not follows:
            return ", its stacks rates fitted on smaller engines"
        keeps = ([] if self._bench_trainer_seqs else [lone]) + ([two_trainers] if self._two_trainers else [])

        def clause(subjects: list[tuple[str, bool]], verb: str) -> str:
            one = len(subjects) == 1 and not subjects[0][1]
            return f"{' and '.join(w for w, _ in subjects)} {verb}{'s' if one else ''}"

        note = f": {clause(follows, 'follow')} the bench"
        return note + (f"; {clause(keeps, 'keep')} the fit's engine size" if keeps else "")

    def generate(self, a: Generate) -> None:
        delay = (a.not_before_s or 0.0) - self.env.now  # arm.hold_apart: start no earlier than that
        if delay > 0:
            self.env.process(self._held(a, delay))
            return
        self._submit(a)

    def _held(self, a: Generate, delay: float):
        yield self.env.timeout(delay)
        self._submit(a)

    def _submit(self, a: Generate) -> None:
        batch = []
        for r in a.requests:
            job = self.jobs[r.job_id]
            rng = np.random.default_rng([job.seed, r.step])
            lengths = sample_response_tokens(job, r.step, rng)
            batch.append((r.job_id, r.step, r.adapter_version, job.prompts_per_step,
                          prompt_tokens(job), lengths))
        seqs = sum(len(b[-1]) for b in batch)
        if self._bench_seqs is not None and seqs > self._bench_seqs:
            self.cost.note_beyond("sequences one engine of stacks generates at once, past the two-engine "
                                  "bench's largest engine (sharing.engines_by_batch)", seqs, self._bench_seqs)
        if self._bench_trainer_seqs is not None and seqs > self._bench_trainer_seqs:
            self.cost.note_beyond("sequences one engine of stacks generates at once, past the bench's largest engine "
                                  "beside the other stack's trainer (sharing.engines_by_batch[].mps_beside_trainer)",
                                  seqs, self._bench_trainer_seqs)
        if self._stacks_fit_seqs is not None and seqs > self._stacks_fit_seqs:
            self.cost.note_beyond(f"sequences one engine of stacks generates at once{self._past_fit} "
                                  "(sharing.stacks_engine_sequences)", seqs, self._stacks_fit_seqs)
        self.engines[a.stack].submit(a.action_id, batch)

    def train(self, a: Train) -> None:
        self.env.process(self._train(a))

    def publish(self, a: Publish) -> None:
        self.env.process(self._publish(a))

    def wait(self) -> Result:
        while not self._done:
            if self.env.peek() == math.inf:
                raise RuntimeError("simulation stalled: no action in flight can finish")
            self.env.run(until=self._signal)
        return self._done.popleft()

    def start_versions(self) -> dict:
        return {}

    def evaluate(self) -> dict[str, dict]:
        return {}

    def diagnostics(self) -> dict:
        # Steps past the engine's CUDA graphs: how much queueing past max_num_seqs cost the run.
        return {"outside_profile": sorted(self.cost.flags),
                "graph_max_tokens": self.engines[0].graph_max_tokens,
                "graphless_steps": sum(e.graphless_steps for e in self.engines),
                "adapter_slots": self.engines[0].max_loras}

    def close(self) -> None:
        pass

    # -- internals --------------------------------------------------------------------------
    def _finish(self, result: Result) -> None:
        self._done.append(result)
        if not self._signal.triggered:
            self._signal.succeed()
        self._signal = self.env.event()

    def _generated(self, act) -> None:
        rollouts = tuple(Rollouts(
            job_id=r.job_id, step=r.step, adapter_version=r.version, n_sequences=len(r.lengths),
            prompt_tokens=r.prompt_tokens_each * len(r.lengths), response_tokens=tuple(r.lengths),
            start_s=r.start_s, end_s=r.end_s) for r in act.requests)
        self._finish(GenerateDone(act.action_id, act.start_s, self.env.now, rollouts))

    def _train(self, a: Train):
        # The host's handoff first (train.handoff_s_per_*): the real backend's train span starts once
        # the batch reaches the trainer process.
        handoff = self.cost.handoff_s(sum(b.n_sequences for b in a.batches), sum(
            self.cfg.audit.audited(b.step, b.n_sequences, self.jobs[b.job_id].responses_per_prompt) for b in a.batches),
            self.cfg.arm.stacks)
        if handoff > 0:
            yield self.env.timeout(handoff)
        start = self.env.now
        tokens = {b.job_id: b.prompt_tokens + sum(b.response_tokens) for b in a.batches}
        # The real trainer's packing: rows (prompt + response) longest first into micro-batches
        # of at most the cap in padded tokens; the cost is charged on the padded tokens.
        share = self._share
        rows = [step_rows(b.prompt_tokens, b.n_sequences, b.response_tokens,
                          self.jobs[b.job_id].responses_per_prompt, share)
                for b in a.batches]
        mb_tokens = self.cfg.trainer.max_tokens_per_microbatch
        padded, regroup = microbatch_costs(rows, mb_tokens, self.cost.profile.train.extra_tokens_layout)
        pairs = packed_pairs_per_microbatch(rows, mb_tokens) if share else []
        # jobs[].beta > 0: a forward pass of the base model over those jobs' tokens (the KL's reference)
        kl = sum(tokens[b.job_id] for b in a.batches if self.jobs[b.job_id].beta) / max(sum(tokens.values()), 1)
        work = self.cost.train_s(padded, adapters=len(a.batches), regroup_tokens=regroup, packed_pairs=pairs,
                                 kl_fraction=kl)
        yield from self.gpu.work("trainer", work)
        updates = tuple(JobUpdate(b.job_id, new_version=v + 1, tokens=tokens[b.job_id])
                        for b, v in zip(a.batches, a.expected_versions))
        self._finish(TrainDone(a.action_id, start, self.env.now, updates))

    def _publish(self, a: Publish):
        start = self.env.now
        # Saving adapters is host-side work (device-to-host copy and a write); it holds the
        # trainer (unless the arm frees it) but not the GPU. The engine pays its load cost at the
        # version's first use. Whatever part of it runs beside a train step on the GPU (a freed
        # trainer's next step) goes corun_factor times slower, rescaled as steps start and end
        # (sim.gpu.host_work).
        pub = self.cost.profile.publish
        yield from self.gpu.host_work(pub.save_s_per_publish + pub.save_s_per_adapter * len(a.versions),
                                      pub.corun_factor)
        for job_id, v in a.versions:
            self.engines[a.stack].publish(job_id, v)
        self._finish(PublishDone(a.action_id, start, self.env.now, a.versions))
