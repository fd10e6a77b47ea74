"""The SimPy backend of nodus: a discrete-event model of one GPU's engine and trainer phases."""

from __future__ import annotations


def backend_factory(profile: str):
    """A `make_backend(cfg, n_stacks)` for the runner, all runs sharing one loaded profile.

    A run whose config leaves the trainer's micro-batch at its default, on a graphed profile whose
    GPU's memory is known (measured by ``nodus calibrate``, else ``nodus.gpumemory.GPU_MEMORY_GIB``), trains at the micro-batch the real
    backend would fit for its stacks (``nodus.gpumemory.fitted_microbatch``: two stacks on an H200,
    8192; their one-stack dedicated baseline keeps 16384). ``make.fitted`` records each fit
    (stacks -> tokens)."""
    from nodus.gpumemory import fitted_microbatch, profile_gpu_memory
    from sim.backend import SimBackend
    from sim.profile import load_profile

    cost = load_profile(profile)
    mem = profile_gpu_memory(cost.profile.environment) if cost.profile.train.step_mode == "graphed" else None

    def make(cfg, n_stacks: int):
        asked = cfg.trainer.max_tokens_per_microbatch
        if mem is not None and "max_tokens_per_microbatch" not in cfg.trainer.model_fields_set:
            mb = fitted_microbatch(asked, n_stacks, mem)
            if mb != asked:
                make.fitted[n_stacks] = mb
                cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(
                    update={"max_tokens_per_microbatch": mb})})
        return SimBackend(cfg, cost, n_stacks)

    make.cost = cost
    make.fitted = {}
    return make
