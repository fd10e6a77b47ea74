"""Where a trainer step's time goes: one call under torch.profiler, summarised.

Used by ``experiments/bench_trainer.py --profile`` and, inside a real run, by the trainer worker
when ``NODUS_TRAINER_PROFILE`` names a file (``NODUS_TRAINER_PROFILE_AT``: which train command,
default the 3rd, past compilation and allocator growth). The wall time against the GPU's kernel
time says whether the step is launch-bound (busy well under 1) or GPU-bound.
"""

from __future__ import annotations

import time
from typing import Callable


def profile_call(fn: Callable[[], object], device, label: str) -> dict:
    """Run ``fn`` once under torch.profiler; its wall time, the GPU's kernel time, the trainer's
    phases (``record_function`` labels ``nodus.*``), the top kernels and the top host ops."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()

    def dev_us(e):
        return getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) or 0

    # GPU time: the kernels and copies themselves (the ops and labels above them would count it twice).
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA]
    kernel_us = sum(e.self_device_time_total for e in kernels)
    phases = {e.key: {"cpu_s": round(e.cpu_time_total / 1e6, 4), "calls": e.count,
                      "device_s": round((getattr(e, "device_time_total", 0) or 0) / 1e6, 4)}
              for e in events if e.key.startswith("nodus.")}
    top = sorted(events, key=dev_us, reverse=True)[:30]
    cpu_top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    return {"label": label, "wall_s": round(wall, 4), "kernel_s": round(kernel_us / 1e6, 4),
            "kernels": len(kernels), "gpu_busy": round(kernel_us / 1e6 / wall, 3) if wall else None,
            "phases": phases,
            "top_kernels": [{"name": e.key[:120], "s": round(dev_us(e) / 1e6, 4), "calls": e.count} for e in top],
            "top_cpu_ops": [{"name": e.key[:120], "self_cpu_s": round(e.self_cpu_time_total / 1e6, 4),
                             "calls": e.count} for e in cpu_top]}
