"""Where a trainer step's time goes: one call under torch.profiler, summarised.

Used by ``experiments/bench_trainer.py --profile`` and, inside a real run, by the trainer worker
when ``NODUS_TRAINER_PROFILE`` names a file (``NODUS_TRAINER_PROFILE_AT``: which train command,
default the 3rd, past compilation and allocator growth). The wall time against the GPU's kernel
time says whether the step is launch-bound (busy well under 1) or GPU-bound.
"""

from __future__ import annotations

import os
import time
from typing import Callable


def trainer_profile_setting() -> tuple[str | None, int]:
    """``NODUS_TRAINER_PROFILE`` (the file a trainer worker appends its profiled train command's
    summary to; None: no profile) and ``NODUS_TRAINER_PROFILE_AT`` (which train command, default the
    3rd). A run reads it before any process starts (``real.backend.check_run_settings``), so a bad
    value is refused at once, not after the engine's start; each trainer worker reads it again."""
    at = os.environ.get("NODUS_TRAINER_PROFILE_AT", "3")
    if not (at.isdigit() and int(at) >= 1):
        raise ValueError(f"NODUS_TRAINER_PROFILE_AT={at!r}: the train command to profile, an integer >= 1")
    return os.environ.get("NODUS_TRAINER_PROFILE") or None, int(at)


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
    kernels = unique_kernels(e for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA
                             and not is_annotation(e))
    kernel_us = sum(end - start for _, start, end in kernels)
    phases = {e.key: {"cpu_s": round(e.cpu_time_total / 1e6, 4), "calls": e.count,
                      "device_s": round((getattr(e, "device_time_total", 0) or 0) / 1e6, 4)}
              for e in events if e.key.startswith("nodus.")}
    top = sorted(events, key=dev_us, reverse=True)[:30]
    cpu_top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    return {"label": label, "wall_s": round(wall, 4), "kernel_s": round(kernel_us / 1e6, 4),
            "kernels": len(kernels), "gpu_busy": round(kernel_us / 1e6 / wall, 3) if wall else None,
            "phases": phases,
            "busy_s": round(union_us([(s, e) for _, s, e in kernels]) / 1e6, 4),
            "kernel_groups": kernel_groups(kernels),
            "top_kernels": [{"name": e.key[:120], "s": round(dev_us(e) / 1e6, 4), "calls": e.count} for e in top],
            "top_cpu_ops": [{"name": e.key[:120], "self_cpu_s": round(e.self_cpu_time_total / 1e6, 4),
                             "calls": e.count} for e in cpu_top]}


def is_annotation(event) -> bool:
    """A ``record_function`` label's span on the GPU's timeline (``nodus.*``, ``Optimizer.step#...``):
    not a kernel, and it covers the kernels under it."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith(("nodus.", "Optimizer."))


def unique_kernels(events) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of each kernel or copy once (the profiler can list a kernel both on
    its own and under the op that launched it)."""
    seen = {}
    for e in events:
        tr = e.time_range
        seen[(e.name, tr.start, tr.end)] = None
    return sorted(seen, key=lambda k: k[1])


def union_us(spans: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one span: the time the GPU had work."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


# Kernel name patterns, first match wins: what kind of work a kernel is.
KERNEL_KINDS = (("gemm", ("nvjet", "gemm", "cutlass", "sm90_xmma", "cublas", "splitk")),
                ("attention", ("sdpa", "flash", "fmha", "attention")),
                ("copy", ("memcpy", "memset", "copy")),
                ("reduce", ("reduce", "norm", "softmax", "scatter", "index")),
                ("triton", ("triton",)),
                ("elementwise", ("elementwise", "foreach")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def kernel_groups(kernels: list[tuple[str, float, float]], top: int = 40) -> dict:
    """GPU time by kind of kernel and by kernel name (the ``top`` largest), seconds and calls."""
    kinds, names = {}, {}
    for name, s, e in kernels:
        for table, key in ((kinds, kernel_kind(name)), (names, name[:160])):
            row = table.setdefault(key, [0.0, 0])
            row[0] += e - s
            row[1] += 1
    fmt = (lambda table: [{"name": k, "s": round(v[0] / 1e6, 4), "calls": v[1]}
                          for k, v in sorted(table.items(), key=lambda kv: -kv[1][0])])
    return {"by_kind": fmt(kinds), "by_name": fmt(names)[:top]}
