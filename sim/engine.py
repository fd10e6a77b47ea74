"""The simulated vLLM engine: continuous batching of every job's sequences on one GPU client.

One event per batch-composition change, not per token: the engine fast-forwards decoding to the
next sequence completion (k steps of the step time for the current batch), and re-plans when a
sequence finishes or when new requests arrive (they join at the next step boundary).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, field

import simpy

from nodus.config import AuditSpec
from sim.gpu import SharedGPU
from sim.profile import CostModel


@dataclass
class _Prompt:
    """One prompt and its n responses, waiting for admission."""

    req: "_JobRequest"
    prompt_tokens: int
    lengths: list[int]
    asks: int = 0  # its first `asks` responses return their sampled tokens' logprobs (the audit)


@dataclass
class _JobRequest:
    job_id: str
    step: int
    version: int
    prompt_tokens_each: int
    lengths: list[int]
    action: "_Action"
    remaining: int = 0
    start_s: float | None = None
    end_s: float | None = None


@dataclass
class _Action:
    action_id: str
    requests: list[_JobRequest] = field(default_factory=list)
    remaining: int = 0
    start_s: float | None = None


class SimEngine:
    """on_done(action_id, start_s, end_s, requests) is called when an action's last sequence ends."""

    def __init__(self, env: simpy.Environment, gpu: SharedGPU, cost: CostModel, max_num_seqs: int,
                 max_loras: int, on_done, graph_max_tokens: int, audit: AuditSpec | None = None):
        self.env, self.gpu, self.cost = env, gpu, cost
        # The run's audit (RunConfig.audit): which sequences return logprobs. None or the full audit:
        # every sequence does, as the profile's decode curves were measured.
        self.audit = audit if audit is not None and not audit.is_full() else None
        self.max_num_seqs, self.max_loras = max_num_seqs, max_loras
        self.graph_max_tokens = graph_max_tokens  # the engine's largest CUDA graph (tokens per step)
        self.on_done = on_done
        self.published: dict[str, int] = {}  # version each job's requests must use
        self.loaded: dict[str, int] = {}  # version resident in the engine
        self.waiting: deque[_Prompt] = deque()
        self._arrival = env.event()
        self.steps_run = 0
        self.graphless_steps = 0  # steps run past the CUDA-graph sizes (mid-batch admissions)
        env.process(self._loop())

    def submit(self, action_id: str, jobs: list[tuple[str, int, int, int, int, list[int]]]) -> None:
        """jobs: (job_id, step, version, prompts, prompt_tokens_each, response lengths)."""
        act = _Action(action_id)
        for job_id, step, version, prompts, ptoks, lengths in jobs:
            if self.published.get(job_id, 0) != version:
                raise RuntimeError(f"engine: job {job_id} asks version {version}, "
                                   f"published is {self.published.get(job_id, 0)}")
            req = _JobRequest(job_id, step, version, ptoks, lengths, act, remaining=len(lengths))
            act.requests.append(req)
            act.remaining += len(lengths)
            n = len(lengths) // prompts
            for p in range(prompts):
                chunk = lengths[p * n:(p + 1) * n] if p < prompts - 1 else lengths[p * n:]
                asks = len(chunk) if self.audit is None else self.audit.asking(step, len(chunk))
                self.waiting.append(_Prompt(req, ptoks, chunk, asks))
        if not self._arrival.triggered:
            self._arrival.succeed()

    def publish(self, job_id: str, version: int) -> None:
        self.published[job_id] = version

    def _lora_fits(self, job_id: str, adapters: Counter) -> bool:
        """Whether a request of ``job_id`` may join a batch holding ``adapters`` (max_loras)."""
        return job_id in adapters or len(adapters) < self.max_loras

    def _loop(self):
        env, cost = self.env, self.cost
        step = 0  # decode steps so far
        finishes: list[int] = []  # heap of distinct finish steps
        # finish step -> (req, count, ctx each, of them returning logprobs)
        at: dict[int, list[tuple[_JobRequest, int, int, int]]] = {}
        running, ctx, asking = 0, 0, 0
        adapters: Counter[str] = Counter()
        while True:
            # Cold: the engine starts from idle (nothing running), also for a run's first requests.
            cold = not running
            if not running and not self.waiting:
                if self._arrival.triggered:
                    self._arrival = env.event()
                yield self._arrival
            if self._arrival.triggered:
                self._arrival = env.event()
            # Admit whole prompts, first come first served, within max_num_seqs and max_loras.
            tokens, load_s = 0, 0.0
            while self.waiting:
                p = self.waiting[0]
                n = len(p.lengths)
                if running and running + n > self.max_num_seqs:
                    break
                key = p.req.job_id
                if not self._lora_fits(key, adapters):
                    break
                self.waiting.popleft()
                if self.loaded.get(key) != p.req.version:
                    load_s += cost.profile.publish.engine_load_s
                    self.loaded[key] = p.req.version
                if p.req.start_s is None:
                    p.req.start_s = env.now
                if p.req.action.start_s is None:
                    p.req.action.start_s = env.now
                tokens += p.prompt_tokens
                adapters[key] += n
                running += n
                for (length, asks), c in Counter((x, i < p.asks) for i, x in enumerate(p.lengths)).items():
                    f = step + length
                    if f not in at:
                        at[f] = []
                        heapq.heappush(finishes, f)
                    at[f].append((p.req, c, p.prompt_tokens + length, c if asks else 0))
                ctx += n * p.prompt_tokens
                asking += p.asks
            pre = cost.prefill_s(tokens, lora=True, cold=cold) if tokens else 0.0
            if pre + load_s > 0:
                yield from self.gpu.work("engine", pre + load_s)
            # Decode to the next completion, or to the step boundary after a new arrival.
            k = finishes[0] - step
            tau = cost.decode_step_s(running, ctx + running * (k - 1) / 2, len(adapters),
                                     None if self.audit is None else asking)
            can_admit = running < self.max_num_seqs
            done = yield from self.gpu.work("engine", k * tau, self._arrival if can_admit else None, batch=running)
            n = k
            if done < k * tau - 1e-12:
                n = min(k, math.ceil(done / tau - 1e-9))
                if n * tau > done:  # finish the step in flight; arrivals join after it
                    yield from self.gpu.work("engine", n * tau - done, batch=running)
            step += n
            ctx += running * n
            self.steps_run += n
            finished_here = bool(finishes) and finishes[0] <= step
            while finishes and finishes[0] <= step:
                for req, c, seq_ctx, lp in at.pop(heapq.heappop(finishes)):
                    running -= c
                    ctx -= c * seq_ctx
                    asking -= lp
                    adapters[req.job_id] -= c
                    if adapters[req.job_id] == 0:
                        del adapters[req.job_id]
                    req.remaining -= c
                    if req.remaining == 0:
                        req.end_s = env.now
                    req.action.remaining -= c
                    if req.action.remaining == 0:
                        self.on_done(req.action)
            # vLLM admits a waiting request into each freed slot at once (one slot is enough: it
            # admits requests, not whole prompts): the next step carries its prompt's prefill beside
            # the running batch's decode, and past the engine's CUDA-graph sizes that step runs
            # without graphs. (Admissions of arriving requests come as prefill chunks, whose cost
            # the profile's prefill term holds.)
            if finished_here and self.waiting and running and self._lora_fits(self.waiting[0].req.job_id, adapters):
                extra = cost.graphless_extra_s(running + self.waiting[0].prompt_tokens, running, len(adapters),
                                               self.graph_max_tokens)
                if extra > 0:
                    self.graphless_steps += 1
                    yield from self.gpu.work("engine", extra, batch=running)
