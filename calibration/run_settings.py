"""What a recorded run ran with, read from its summary's diagnostics: the settings beyond the
defaults that change its phases' speed (``run_controls``: MPS shares and the trainer's priority,
the trainer's step mode, capped CPU threads, engine arguments, the audit, ...), its logprob audit,
and which of them no profile describes (``unmodelled_controls``), so `nodus validate`, `nodus fit`
and the GPU table can name what a run's error may come from.
"""

from __future__ import annotations

from nodus.config import (NO_CORUN_POLICIES, AuditSpec, corun_key, drop_idle_priority, shipped_profile,
                          stacks_of, stacks_under_mps)


def run_audit(summary: dict) -> dict:
    """A run's logprob audit settings as its diagnostics recorded them (logprobs, every, responses;
    the last entry that has them), {} for a run before the record (the default audit)."""
    return next((d["audit"] for d in reversed(summary.get("diagnostics", [])) if d.get("audit")), {})


def audit_text(audit: dict) -> str:
    """A run's logprob audit (its diagnostics' ``audit``: logprobs, every, responses) in words when
    it is not the default (every step, every response): ``AuditSpec.words``; "" at the default."""
    return AuditSpec.from_record(audit).words()


def audit_label(audit: dict) -> str:
    """The same as a table label: "a0" (off), "a4" (every 4th step), "r1" (1 response a prompt),
    "a4r1"; "" at the default."""
    if audit.get("logprobs") is False:
        return "a0"
    every, responses = audit.get("every") or 1, audit.get("responses")
    return (f"a{every}" if every != 1 else "") + (f"r{responses}" if responses is not None else "")


def trainer_cpu_cap(diagnostics: dict) -> int | None:
    """torch's CPU threads in a backend's trainers where capped (RealOptions.trainer_cpu_threads;
    nodus's default on a GPU since session 28), else None. A trainer records None on torch's own
    count, beside ``torch_threads``; the first runs to record the field (session 28's call c, no
    ``torch_threads``) recorded that count itself, the host's CPUs, which is read as no cap."""
    cpus = (diagnostics.get("host") or {}).get("cpus")
    caps = [w["cpu_threads"] for name, w in (diagnostics.get("workers") or {}).items()
            if name.startswith("trainer") and w.get("cpu_threads")
            and ("torch_threads" in w or not cpus or w["cpu_threads"] < cpus)]
    return max(caps) if caps else None


def trainer_step_modes(summary: dict) -> list[str]:
    """Each recorded trainer's step mode ("eager", "graphed", "static"), over every diagnostics entry
    (a dedicated run records its one trainer once a job); trainers that recorded none are left out."""
    return [w["step_mode"] for d in summary.get("diagnostics", []) for name, w in (d.get("workers") or {}).items()
            if name.startswith("trainer") and w.get("step_mode")]


def run_controls(summary: dict) -> dict:
    """The settings a run used beyond the defaults that change its phases' speed, from its
    diagnostics: MPS thread percentages and trainer priority, ``trainer_step_mode`` for a trainer
    that replayed CUDA graphs (``--trainer-graphs``; "graphed N of M" where only N of the run's M
    recorded trainers did, the others' capture having failed), ``engine_args`` for extra vLLM arguments
    (``--engine-arg``), ``engine_core_process`` for vLLM's core in its own process
    (``--engine-core-process``), ``trainer_cpu_threads`` for torch's CPU threads in the trainers
    where capped (``trainer_cpu_cap``), ``publish_pinned`` False for adapters the engine loaded into pageable
    host memory (``RealOptions.publish_pinned``), ``adapter_format`` "flat" for adapters the trainer handed
    over as flat files (``RealOptions.adapter_format``; the default since session 65, but every shipped
    profile describes PEFT folders), ``cuda_graph_max_tokens`` for the engine's
    CUDA-graph size set in the config (``engine.cuda_graph_max_tokens``), ``engine_max_loras`` for an
    engine started with more or fewer adapter slots than the run has jobs (recorded since session 21),
    ``engine_env`` for the engine's extra environment variables (their names), ``audit`` for a logprob
    audit on fewer steps or responses than all (``audit_text``), ``engine_cpu_threads`` for torch's CPU
    threads in the engines where capped (``RealOptions.engine_cpu_threads``), and ``lora_kernels``
    "tuned" for an engine that ran tuned LoRA kernel configs (the shipped ones,
    ``real/lora_kernels.py``, or a folder set through the environment). {} for a run
    at the defaults of runs before session 11 (vLLM's own LoRA kernels, the audit every step); a
    default H200 run since gives {"lora_kernels": "tuned"}."""
    from real.backend import RealOptions  # light: no torch, no vLLM
    from real.lora_kernels import ENV as LORA_CONFIG_ENV

    defaults = RealOptions().sharing_controls("mps")
    out = {}
    for d in summary.get("diagnostics", []):
        for k, v in (d.get("sharing_controls") or {}).items():
            if k in defaults and v != defaults[k]:
                out[k] = v
        if d.get("engine_core_process"):
            out["engine_core_process"] = True
        if d.get("publish_pinned") is False:
            out["publish_pinned"] = False  # published adapters loaded into pageable host memory (:np)
        if d.get("adapter_format", "safetensors") != "safetensors":
            out["adapter_format"] = d["adapter_format"]  # adapters handed over as flat files (:flat)
        if d.get("cuda_graph_max_tokens"):
            out["cuda_graph_max_tokens"] = d["cuda_graph_max_tokens"]  # the sim models it (config)
        # One slot per job of an engine's own: the run's jobs, or its largest stack's (arm.stack_jobs).
        own = max((summary.get("arm") or {}).get("stack_jobs") or [summary.get("jobs") or 0])
        if summary.get("jobs") and d.get("engine_max_loras") not in (None, own):
            # An engine with other than one adapter slot per job: more (a pool sized for a larger
            # arm) or fewer (engine.max_loras, which the simulator admits by): another engine
            # (unmodelled_controls compares it with the profile's).
            out["engine_max_loras"] = d["engine_max_loras"]
        if d.get("engine_args"):
            out["engine_args"] = ",".join(f"{k}={v}" for k, v in sorted(d["engine_args"].items()))
        env = dict(d.get("engine_env") or {})
        if env.pop(LORA_CONFIG_ENV, None):
            out["lora_kernels"] = "tuned"  # the folder given through --engine-env
        if env:
            out["engine_env"] = ",".join(sorted(env))
        cap = trainer_cpu_cap(d)
        if cap:
            out["trainer_cpu_threads"] = cap
        for name, w in (d.get("workers") or {}).items():
            if name.startswith("engine") and w.get("cpu_threads"):
                out["engine_cpu_threads"] = w["cpu_threads"]  # RealOptions.engine_cpu_threads
            if name.startswith("engine") and w.get("lora_kernel_configs"):
                out["lora_kernels"] = "tuned"
    modes = trainer_step_modes(summary)
    graphed = [m for m in modes if m != "eager"]
    if graphed:
        # Every trainer replayed its graphs, or only some (the others' capture failed and they
        # trained eager: session 29's two stacks), a mix no profile's trainer terms describe.
        out["trainer_step_mode"] = (graphed[0] if len(graphed) == len(modes)
                                    else f"{graphed[0]} {len(graphed)} of {len(modes)}")
    audit = audit_text(run_audit(summary))
    if audit:
        out["audit"] = audit
    return out


def run_gpu_total_gib(summary: dict) -> float | None:
    """The total memory (GiB) of the GPU a run recorded (diagnostics ``gpu.total_gib``), None for a
    run that recorded none."""
    return next((d["gpu"]["total_gib"] for d in summary.get("diagnostics", [])
                 if (d.get("gpu") or {}).get("total_gib")), None)


def run_profile(config: dict, summary: dict) -> str:
    """The shipped profile that describes a recorded run (``nodus.config.shipped_profile``): its
    trainers' step mode (graphed where any replayed CUDA graphs), its trainer's MPS priority where
    its arm co-runs engine and trainer under MPS (the recorded one, else the backend's default,
    normal), its stacks under MPS, and its GPU's total memory (an H100 80GB has profiles of its
    own; a run that recorded no GPU is priced as the H200's)."""
    arm = config.get("arm") or {}
    policy, sharing, stacks = arm.get("policy"), arm.get("sharing"), stacks_of(arm)
    graphed = any(m != "eager" for m in trainer_step_modes(summary))
    priority = None
    if sharing == "mps" and corun_key(policy, stacks) not in NO_CORUN_POLICIES:
        priority = next((d["sharing_controls"]["trainer_priority"] for d in summary.get("diagnostics", [])
                         if (d.get("sharing_controls") or {}).get("trainer_priority")), "normal")
    return shipped_profile(graphed, priority, stacks_under_mps(policy, sharing, stacks), run_gpu_total_gib(summary),
                           dedicated=policy == "dedicated")


# Run settings the profile's terms were not measured with: such a run is simulated with them
# anyway, and flagged outside the profile (the trainer's step mode: when it is not the profile's).
UNMODELLED_CONTROLS = {"trainer_step_mode": "the trainer replayed CUDA graphs (--trainer-graphs): "
                                            "the profile's trainer terms are the eager step's",
                      "engine_args": "the engine ran with extra vLLM arguments (--engine-arg): the profile's "
                                     "engine terms are the default engine's",
                      "engine_core_process": "the engine's core ran in a process of its own (--engine-core-process): "
                                             "the profile's engine terms are one process's",
                      "engine_cpu_threads": "the engine's torch CPU threads were capped (--engine-cpu-threads): the "
                                            "profile's engine terms were measured on torch's own count",
                      "engine_env": "the engine ran with extra environment (--engine-env, e.g. tuned LoRA "
                                    "kernel configs): the profile's engine terms are the default engine's",
                      "publish_pinned": "the engine loaded published adapters into pageable host memory "
                                        "(publish_pinned false, :np): the profile's publish is vLLM's pinned one",
                      "adapter_format": "the trainer handed adapters to the engine as flat files (:flat): the "
                                        "profile's train and publish terms include the PEFT safetensors save and load",
                      "audit": "the engine returned logprobs on fewer steps or responses (--audit-every / "
                               "--audit-responses / --no-audit): the profile's engine terms were measured returning "
                               "them for every response of every step"}


def sharing_controls(controls: dict, policy: str | None = None) -> dict:
    """The MPS settings among a run's controls (``run_controls``) that are not the defaults
    (thread percentages, the trainer's priority) and that can move its rates: the trainer's
    priority only where the run's ``policy`` co-runs engine and trainer. {} for the defaults."""
    from real.backend import RealOptions  # light: no torch, no vLLM

    keys = RealOptions().sharing_controls("mps")
    return {k: v for k, v in drop_idle_priority(controls, policy).items() if k in keys}


def settings_text(settings: dict) -> str:
    """'trainer_priority=below-normal, trainer_thread_pct=50'; 'the defaults' for none."""
    return ", ".join(f"{k}={v}" for k, v in sorted(settings.items())) or "the defaults"


def mps_settings_differ(controls: dict, profile_sharing: dict | None, mps: bool,
                        policy: str | None = None) -> tuple[dict, dict] | None:
    """For a run under MPS (``mps``), its MPS settings and the profile's (``sharing.controls``) as far
    as its ``policy`` uses them (``sharing_controls``), where they differ; None where they agree."""
    run_sharing = sharing_controls(controls, policy)
    prof_sharing = sharing_controls(dict(profile_sharing or {}), policy)
    return (run_sharing, prof_sharing) if mps and run_sharing != prof_sharing else None


def unmodelled_controls(controls: dict, profile_step_mode: str = "eager",
                        profile_lora_kernels: str = "default", profile_sharing: dict | None = None,
                        mps: bool = False, policy: str | None = None, profile_slots: int | None = None,
                        run_slots: int | None = None, run_jobs: int | None = None,
                        profile_cpu_threads: int | None = None, stacks: int = 1,
                        profile_engines_controls: dict | None = None,
                        run_settings: dict | None = None,
                        profile_adapter_format: str = "safetensors") -> list[str]:
    """What a run's settings (``run_controls``) have that the profile was not measured with;
    ``profile_step_mode``: the trainer its train terms describe (``train.step_mode``);
    ``profile_lora_kernels``: the engine's LoRA kernels its engine terms describe ("tuned" or
    "default", ``sim.profile.profile_lora_kernels``); ``profile_sharing``: the MPS settings its
    MPS rates were fitted under (``sharing.controls``), compared for a run under MPS (``mps``) as
    far as its ``policy`` uses them (``sharing_controls``); ``profile_slots``: the adapter slots of the
    engine its engine terms were measured on (``environment.engine_max_loras``, None where not
    recorded), against the run's engine's (its ``engine_max_loras`` control where it had other than one
    per job, else ``run_slots``, the config's ``engine.max_loras`` or one per job); without the
    profile's, a run with more slots than its ``run_jobs`` (default ``run_slots``);
    ``profile_cpu_threads``: the trainers' capped CPU threads its train terms were measured with
    (``environment.trainer_cpu_threads``; None: torch's own count, every profile before session 28);
    ``stacks``: the run's engine + trainer stacks; ``profile_engines_controls``: the settings the
    profile's two-engine rate was fitted under (``sharing.engines_controls``; None where the profile
    has no ``sharing.mps_engines``), against which a stacks run under MPS is compared, its
    ``run_settings`` (policy, share_prompts) with its controls (``stacks_run_settings``);
    ``profile_adapter_format``: the adapter handoff its train and publish terms describe
    (``environment.adapter_format``), against the run's (its ``adapter_format`` control)."""
    cap = controls.get("engine_cpu_threads")
    fitted = profile_engines_controls or {}
    engines_fitted = stacks > 1 and mps and profile_engines_controls is not None
    out = [UNMODELLED_CONTROLS[k] for k in controls if k in UNMODELLED_CONTROLS
           and k not in ("trainer_step_mode", "adapter_format")
           and not (k == "engine_cpu_threads" and engines_fitted and cap == fitted.get("engine_cpu_threads"))]
    handoff = controls.get("adapter_format", "safetensors")
    if handoff != profile_adapter_format:
        out.append(UNMODELLED_CONTROLS["adapter_format"] if profile_adapter_format == "safetensors" else
                   f"the trainer handed adapters to the engine as {handoff} files; the profile's train and publish "
                   f"terms include the {profile_adapter_format} handoff's save and load (environment.adapter_format)")
    if engines_fitted:
        def threads(n):
            return f"{n} CPU threads" if n else "torch's own CPU thread count"

        given = run_settings or {}
        mine = stacks_run_settings(given.get("policy"), stacks, given.get("share_prompts"), controls)
        for k in sorted(set(fitted) | {m for m in mine if m.startswith("mps.")}):
            have, want = mine.get(k), fitted.get(k)
            if have == want:
                continue
            if k == "engine_cpu_threads":
                out.append(f"the engines ran {threads(have)}; the profile's two-engine rate (sharing.mps_engines) was "
                           f"fitted with {threads(want)} (sharing.engines_controls)")
            else:
                out.append(f"the run's {k} is {have}; the profile's two-engine rate (sharing.mps_engines) was fitted "
                           f"on runs with {want} (sharing.engines_controls)")
    cap = controls.get("trainer_cpu_threads")
    if cap != profile_cpu_threads:
        def said(n):
            return f"{n} CPU threads" if n else "torch's own CPU thread count"

        out.append(f"the trainer ran {said(cap)}; the profile's train terms were measured with "
                   f"{said(profile_cpu_threads)} (environment.trainer_cpu_threads): beside the engine under MPS, a "
                   "trainer capped at 2 trained in half the time of one on 16 (session 28)")
    slots = controls.get("engine_max_loras") or run_slots
    if profile_slots is not None and slots is not None and slots != profile_slots:
        out.append(f"the engine had {slots} adapter slots; the profile's engine terms were measured with "
                   f"{profile_slots} (environment.engine_max_loras)")
    elif profile_slots is None and (controls.get("engine_max_loras") or 0) > (run_jobs or run_slots or 0):
        out.append(f"the engine had {controls['engine_max_loras']} adapter slots, more than the run's jobs (started "
                   "for a larger arm of the invocation); the profile does not say which engine it measured")
    differ = mps_settings_differ(controls, profile_sharing, mps, policy)
    if differ:
        run_sharing, prof_sharing = differ
        out.append(f"the run's MPS settings ({settings_text(run_sharing)}) are not those the profile's MPS rates "
                   f"were fitted under ({settings_text(prof_sharing)}, sharing.controls)")
    kernels = controls.get("lora_kernels", "default")
    if kernels != profile_lora_kernels:
        out.append(f"the engine ran {'tuned' if kernels == 'tuned' else 'vLLM default'} LoRA kernel configs; "
                   f"the profile's engine terms are the {profile_lora_kernels} kernels' "
                   "(real/lora_kernels.py; --no-tuned-lora-kernels runs vLLM's)")
    mode = controls.get("trainer_step_mode", "eager")
    if mode != profile_step_mode:
        out.insert(0, UNMODELLED_CONTROLS["trainer_step_mode"] if profile_step_mode == "eager" and " of " not in mode
                   else f"the trainer ran {mode}; the profile's trainer terms are the {profile_step_mode} step's")
    return out


def stacks_run_settings(policy: str | None, stacks: int, packing: int | None, controls: dict,
                        lockstep: bool = False, offset_stacks: bool = False, hold_apart: float = 0.0) -> dict:
    """What a stacks run's two-engine rate depends on beyond a profile's terms, flat: its policy,
    packing (``packing``: as its trainer ran it, ``RunConfig.trainer_packing``), engine and trainer
    CPU thread caps, and its MPS settings (``mps.<name>``) as a run of ``stacks`` stacks uses them:
    the trainer's priority counts, another stack's generation running beside a train step even
    under shared-sync; ``lockstep: True`` for stacks held in step (arm.lockstep) and
    ``offset_stacks: True`` for stacks started out of step (arm.offset_stacks), ``hold_apart`` for
    stacks then held apart (arm.hold_apart). `nodus
    fit-stacks` records them (``sharing.engines_controls``) and ``unmodelled_controls`` compares a
    run's with them."""
    out = {"policy": policy, "share_prompts": packing,
           "engine_cpu_threads": controls.get("engine_cpu_threads"),
           "trainer_cpu_threads": controls.get("trainer_cpu_threads")}
    out.update({f"mps.{k}": v for k, v in sharing_controls(controls, corun_key(policy, stacks)).items()})
    if lockstep:  # arm.lockstep; absent: free-running stacks, as every profile before the field
        out["lockstep"] = True
    if offset_stacks:  # arm.offset_stacks; absent: the stacks started together
        out["offset_stacks"] = True
    if hold_apart:  # arm.hold_apart; absent: left to drift
        out["hold_apart"] = hold_apart
    return out
