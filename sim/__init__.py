"""The SimPy backend of nodus: a discrete-event model of one GPU's engine and trainer phases."""

from __future__ import annotations


def backend_factory(profile: str):
    """A `make_backend(cfg, n_stacks)` for the runner, all runs sharing one loaded profile."""
    from sim.backend import SimBackend
    from sim.profile import load_profile

    cost = load_profile(profile)

    def make(cfg, n_stacks: int):
        return SimBackend(cfg, cost, n_stacks)

    make.cost = cost
    return make
