"""The GPU's own state while a run runs, sampled through NVML: SM and memory clocks, power draw
against the enforced limit, temperature, utilisation, and the reasons the driver gives for holding
the clocks down (power cap, thermal, hardware slowdown).

Why: on the H200 the 8-job shared-sync + MPS generation (512 sequences) took 2.4-2.7 s a step
on four days and 3.1 s on session 25, while the host probe (``nodus.outdir.host_probe``) read the
same. A GPU slowed under heavy load (power cap, heat, clocks) would do that, and nothing recorded
the GPU's state. The real backend runs a `GpuMonitor` over each run's measured window and keeps its
summary in the run's diagnostics (``gpu_monitor``); ``nodus validate`` flags runs whose GPU ran
slow.

Never raises: without ``pynvml`` (nvidia-ml-py's, or the copy vLLM ships), without a driver,
or when an NVML call fails at the start, ``stop()`` says why instead of giving figures; a call that
fails later ends the sampling, and the figures so far come with ``stopped_early`` (why, and after
how many samples).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from nodus.monitor import SamplingMonitor

# The clock event ("throttle") reasons NVML reports as a bitmask, by the short name the summary
# uses: pynvml's constant suffix (``nvmlClocksEventReason*`` since NVML 12, before that
# ``nvmlClocksThrottleReason*``) and the documented bit, taken where pynvml has neither name.
REASONS = (
    ("gpu_idle", "GpuIdle", 0x1),
    ("applications_clocks_setting", "ApplicationsClocksSetting", 0x2),
    ("sw_power_cap", "SwPowerCap", 0x4),
    ("hw_slowdown", "HwSlowdown", 0x8),
    ("sync_boost", "SyncBoost", 0x10),
    ("sw_thermal_slowdown", "SwThermalSlowdown", 0x20),
    ("hw_thermal_slowdown", "HwThermalSlowdown", 0x40),
    ("hw_power_brake_slowdown", "HwPowerBrakeSlowdown", 0x80),
    ("display_clock_setting", "DisplayClockSetting", 0x100),
)
# The reasons that slow a busy GPU below the clock it was asked for; the others say it is idle or
# at clocks someone set (application clocks, sync boost, display), not that it was held down.
SLOWDOWN_REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                    "hw_power_brake_slowdown")
BUSY_UTIL_PCT = 50  # a sample is "busy" above this utilisation: its SM clock is the one kernels ran at
NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0  # pynvml's values, where it lacks the names


def gpu_indices(n_gpus: int) -> list[int]:
    """NVML indices of the ``n_gpus`` GPUs a run uses (its CUDA devices 0..n-1): the physical
    indices $CUDA_VISIBLE_DEVICES lists when it lists integers, else 0..n-1 (unset, UUIDs, MIG).
    NVML numbers GPUs in PCI bus order, as CUDA does on a host of identical GPUs."""
    parts = [p.strip() for p in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts):
        return [int(p) for p in parts[:n_gpus]]
    return list(range(n_gpus))


def _vllm_pynvml():
    """The copy of pynvml vLLM ships (``vllm/third_party/pynvml.py``, plain ctypes), loaded from its
    file without importing the ``vllm`` package: that import runs vLLM's env overrides (it imports
    torch and sets TORCHINDUCTOR_COMPILE_THREADS=1, among others, which processes the run starts
    later would inherit)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")  # locates the package; runs none of it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("no vllm package")
    path = Path(list(spec.submodule_search_locations)[0]) / "third_party" / "pynvml.py"
    if not path.is_file():
        raise ImportError(f"no {path}")
    name = "nodus_vllm_pynvml"
    if name in sys.modules:
        return sys.modules[name]
    mspec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(mspec)
    sys.modules[name] = mod  # the module looks itself up there while it loads
    try:
        mspec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def load_pynvml():
    """The pynvml module: nvidia-ml-py's (``pynvml``), else the copy vLLM ships (the H200 device
    bundle has only that one); a string saying why where neither loads."""
    import importlib

    errors = []
    for name, load in (("pynvml", lambda: importlib.import_module("pynvml")), ("vllm's copy", _vllm_pynvml)):
        try:
            return load()
        except Exception as e:  # noqa: BLE001 - not installed, or broken
            errors.append(f"{name}: {type(e).__name__}: {e}")
    return "no pynvml (" + "; ".join(errors) + ")"


def reason_bits(nv) -> dict[str, int]:
    """Each reason's bit in ``nv`` (a pynvml module): its constant where pynvml has one."""
    out = {}
    for name, suffix, bit in REASONS:
        v = getattr(nv, f"nvmlClocksEventReason{suffix}", None)
        if v is None:
            v = getattr(nv, f"nvmlClocksThrottleReason{suffix}", bit)
        out[name] = int(v)
    return out


class GpuMonitor(SamplingMonitor):
    """Samples the run's GPUs every ``interval_s`` in a daemon thread between `start` and `stop`.
    A sample is 7 NVML calls per GPU (tens of microseconds each): at the default 0.2 s, well under
    1 ms of the controller's time a second."""

    thread_name = "nodus-gpumon"

    def __init__(self, n_gpus: int = 1, interval_s: float = 0.2):
        super().__init__(interval_s)
        self.n_gpus = n_gpus
        self._samples: dict[int, list[tuple]] = {}  # per NVML index: (sm, mem MHz, W, limit W, C, util %, reasons)
        self._static: dict[int, dict] = {}
        self._t0 = self._t1 = None

    def _begin(self) -> None:
        """Initialise NVML and take the first sample; on any failure, record why."""
        if self.n_gpus < 1:
            self._why = "the run uses no GPU"
            return
        nv = load_pynvml()
        if isinstance(nv, str):
            self._why = nv
            return
        self._nv = nv
        try:
            nv.nvmlInit()
        except Exception as e:  # noqa: BLE001 - no driver
            self._why = f"nvmlInit failed ({type(e).__name__}: {e})"
            return
        self._sm = getattr(nv, "NVML_CLOCK_SM", NVML_CLOCK_SM)
        self._mem = getattr(nv, "NVML_CLOCK_MEM", NVML_CLOCK_MEM)
        self._temp = getattr(nv, "NVML_TEMPERATURE_GPU", NVML_TEMPERATURE_GPU)
        self._bits = reason_bits(nv)
        try:
            self._reasons = (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                             or nv.nvmlDeviceGetCurrentClocksThrottleReasons)
            self._handles = {i: nv.nvmlDeviceGetHandleByIndex(i) for i in gpu_indices(self.n_gpus)}
            for i, h in self._handles.items():
                self._static[i] = {"max_sm_clock_mhz": float(nv.nvmlDeviceGetMaxClockInfo(h, self._sm)),
                                   "uuid": gpu_uuid(nv, h)}
                self._samples[i] = []
            self._sample()  # one at once: a query the GPU does not answer fails here, not in the thread
        except Exception as e:  # noqa: BLE001 - a bad index, an unsupported query
            self._why = self._failure(e)
            self._release()
            return
        self._t0 = time.monotonic()

    def _sample(self) -> None:
        nv = self._nv
        for i, h in self._handles.items():
            row = (float(nv.nvmlDeviceGetClockInfo(h, self._sm)), float(nv.nvmlDeviceGetClockInfo(h, self._mem)),
                   nv.nvmlDeviceGetPowerUsage(h) / 1000.0, nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
                   float(nv.nvmlDeviceGetTemperature(h, self._temp)),
                   float(nv.nvmlDeviceGetUtilizationRates(h).gpu), int(self._reasons(h)))
            with self._lock:
                self._samples[i].append(row)

    def _failure(self, e: Exception) -> str:
        n = max((len(s) for s in self._samples.values()), default=0)
        return f"NVML call failed after {n} samples ({type(e).__name__}: {e})"

    def _after_join(self, alive: bool) -> None:
        # The figures cover the window up to the thread's failure, else up to the stop; a hung
        # NVML call keeps the library it is in (the base releases it only once the thread ended).
        self._t1 = self._stopped_s or time.monotonic()
        super()._after_join(alive)

    def _release(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down what failed
            pass

    def _summary(self) -> dict:
        """Per GPU (NVML index): the samples, SM clock (mean, min, 10th percentile) against its
        maximum, memory clock, power against the enforced limit, temperature, utilisation, the
        fraction of samples above ``BUSY_UTIL_PCT`` utilisation and their mean SM clock (the clock
        the kernels ran at), and per clock event reason seen the fraction of samples it was active
        in; the window's ``seconds`` and ``stopped_early`` where the thread's sampling failed."""
        with self._lock:
            samples = {i: list(s) for i, s in self._samples.items()}
        return {"available": True, "interval_s": self.interval_s,
                "seconds": (self._t1 or 0.0) - (self._t0 or 0.0),
                **({"stopped_early": self._stopped} if self._stopped else {}),
                "gpus": {str(i): {**summarise(s, self._static[i]["max_sm_clock_mhz"], self._bits),
                                  **({"uuid": self._static[i]["uuid"]} if self._static[i]["uuid"] else {})}
                         for i, s in samples.items()}}


def gpu_uuid(nv, handle) -> str | None:
    """The GPU's UUID (NVML; ``GPU-...``): the same model on two machines is two GPUs. None where
    the binding or the driver does not answer."""
    try:
        u = nv.nvmlDeviceGetUUID(handle)
    except Exception:  # noqa: BLE001 - an older binding or driver: the run goes on without it
        return None
    return (u.decode() if isinstance(u, bytes) else str(u)) or None


def summarise(samples: list[tuple], max_sm_clock_mhz: float, bits: dict[str, int]) -> dict:
    """One GPU's samples (sm, mem MHz, W, limit W, C, util %, reasons bitmask) as its summary."""
    a = np.array([s[:6] for s in samples], dtype=float).reshape(-1, 6)
    sm, mem, w, limit, temp, util = a.T
    busy = util > BUSY_UTIL_PCT
    masks = [s[6] for s in samples]
    throttle = {}
    for name, bit in bits.items():
        frac = sum(1 for m in masks if m & bit) / len(masks) if masks else 0.0
        if frac > 0:
            throttle[name] = frac

    def stat(x, f):
        return float(f(x)) if len(x) else None

    return {"samples": len(samples),
            "sm_clock_mhz": {"mean": stat(sm, np.mean), "min": stat(sm, np.min),
                             "p10": stat(sm, lambda x: np.percentile(x, 10))},
            "max_sm_clock_mhz": max_sm_clock_mhz, "mem_clock_mhz": {"mean": stat(mem, np.mean)},
            "power_w": {"mean": stat(w, np.mean), "max": stat(w, np.max)},
            "power_limit_w": stat(limit, np.min),  # the tightest limit enforced while sampled
            "temp_c": {"max": stat(temp, np.max)}, "util_pct": {"mean": stat(util, np.mean)},
            "busy": {"fraction": float(busy.mean()) if len(busy) else 0.0, "sm_clock_mhz": stat(sm[busy], np.mean)},
            "throttle": throttle}
