"""The GPU monitor (nodus.gpumon) against a scripted fake pynvml: its summary figures, the GPUs it
picks, and that it never raises and never leaves its thread running."""

import os
import sys
import threading
import time
import types

import pytest

from nodus import gpumon
from nodus.gpumon import GpuMonitor, gpu_indices, reason_bits

IDLE = (345, 2619, 80_000, 700_000, 35, 0, 0x1)  # sm, mem MHz, power mW, limit mW, C, util %, reasons
BUSY = (1980, 2619, 500_000, 700_000, 60, 95, 0)
CAPPED = (1600, 2619, 700_000, 700_000, 70, 99, 0x4)  # held down by the software power cap
SCRIPT = [IDLE, IDLE] + [BUSY] * 6 + [CAPPED] * 2


def fake_pynvml(script=SCRIPT, api="event", fail=None):
    """A pynvml whose GPUs each answer ``script``, one sample after another (a sample ends with its
    reasons call; past the end it starts over). ``api``: "event" (NVML 12+ names), "throttle" (the
    older ones); its reason constants are left out, so the documented bits must be used. ``fail``:
    the name of a function that raises."""
    nv = types.SimpleNamespace(NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, NVML_TEMPERATURE_GPU=0)
    nv.served, nv.asked, nv.shutdowns = {}, [], []

    def row(h):
        return script[nv.served.get(h, 0) % len(script)]

    def reasons(h):
        r = row(h)[6]
        nv.served[h] = nv.served.get(h, 0) + 1
        return r

    nv.nvmlInit = lambda: None
    nv.nvmlShutdown = lambda: nv.shutdowns.append(1)
    nv.nvmlDeviceGetHandleByIndex = lambda i: nv.asked.append(i) or i
    nv.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980
    nv.nvmlDeviceGetUUID = lambda h: f"GPU-fake-{h}".encode()  # older bindings answer bytes
    nv.nvmlDeviceGetClockInfo = lambda h, kind: row(h)[{1: 0, 2: 1}[kind]]
    nv.nvmlDeviceGetPowerUsage = lambda h: row(h)[2]
    nv.nvmlDeviceGetEnforcedPowerLimit = lambda h: row(h)[3]
    nv.nvmlDeviceGetTemperature = lambda h, sensor: row(h)[4]
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=row(h)[5], memory=0)
    setattr(nv, {"event": "nvmlDeviceGetCurrentClocksEventReasons",
                 "throttle": "nvmlDeviceGetCurrentClocksThrottleReasons"}[api], reasons)
    if fail:
        def boom(*a):
            raise RuntimeError("NVMLError_NotSupported")
        setattr(nv, fail, boom)
    return nv


def scripted(monkeypatch, nv, n_samples, n_gpus=1) -> dict:
    """The summary of exactly ``n_samples`` samples: the thread never wakes (an hour's interval)
    beside start's first sample; the rest are taken here."""
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    m = GpuMonitor(n_gpus=n_gpus, interval_s=3600).start()
    for _ in range(n_samples - 1):
        m._sample()
    return m.stop()


@pytest.mark.parametrize("api", ["event", "throttle"])
def test_the_summary_gives_clocks_power_and_throttle_fractions(monkeypatch, api):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = scripted(monkeypatch, fake_pynvml(api=api), len(SCRIPT))
    assert s["available"] and list(s["gpus"]) == ["0"]
    g = s["gpus"]["0"]
    assert g["samples"] == 10 and g["max_sm_clock_mhz"] == 1980
    assert g["uuid"] == "GPU-fake-0"  # which GPU: the same model on two machines is two GPUs
    assert g["sm_clock_mhz"] == {"mean": pytest.approx((2 * 345 + 6 * 1980 + 2 * 1600) / 10), "min": 345,
                                 "p10": pytest.approx(345)}
    assert g["mem_clock_mhz"]["mean"] == pytest.approx(2619)
    assert g["power_w"] == {"mean": pytest.approx((2 * 80 + 6 * 500 + 2 * 700) / 10), "max": pytest.approx(700)}
    assert g["power_limit_w"] == pytest.approx(700) and g["temp_c"]["max"] == 70
    assert g["util_pct"]["mean"] == pytest.approx((6 * 95 + 2 * 99) / 10)
    # Busy (util > 50%): 8 of 10 samples, at the clock the kernels ran at, not dragged down by idle.
    assert g["busy"] == {"fraction": pytest.approx(0.8), "sm_clock_mhz": pytest.approx((6 * 1980 + 2 * 1600) / 8)}
    assert g["throttle"] == {"gpu_idle": pytest.approx(0.2), "sw_power_cap": pytest.approx(0.2)}  # only those seen


def test_reason_bits_take_pynvmls_constants_over_the_documented_bits():
    nv = types.SimpleNamespace(nvmlClocksEventReasonSwPowerCap=0x4000, nvmlClocksThrottleReasonHwSlowdown=0x8000)
    bits = reason_bits(nv)
    assert bits["sw_power_cap"] == 0x4000 and bits["hw_slowdown"] == 0x8000  # new name, then old
    assert bits["gpu_idle"] == 0x1 and bits["hw_power_brake_slowdown"] == 0x80
    assert bits["display_clock_setting"] == 0x100
    assert reason_bits(types.SimpleNamespace(nvmlClocksEventReasonSwPowerCap=0x4,
                                             nvmlClocksThrottleReasonSwPowerCap=0x99))["sw_power_cap"] == 0x4


def test_cuda_visible_devices_picks_the_physical_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert gpu_indices(1) == [3] and gpu_indices(2) == [3, 5]
    nv = fake_pynvml()
    s = scripted(monkeypatch, nv, 2, n_gpus=2)
    assert nv.asked == [3, 5] and sorted(s["gpus"]) == ["3", "5"] and s["gpus"]["5"]["samples"] == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8a7c1f3e-0000")  # UUIDs: the run's own numbering
    assert gpu_indices(2) == [0, 1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_indices(1) == [0] and gpu_indices(0) == []


def sampling(monkeypatch, samples: int):
    """A monitor on a fresh fake pynvml, once its thread has taken ``samples`` samples (10 s at most)."""
    nv = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    m = GpuMonitor(interval_s=0.005).start()
    deadline = time.monotonic() + 10
    while nv.served.get(0, 0) < samples and time.monotonic() < deadline:
        time.sleep(0.005)
    return m, nv


def test_the_thread_samples_until_stopped_and_stop_is_idempotent(monkeypatch):
    m, nv = sampling(monkeypatch, 5)
    s = m.stop()
    n = s["gpus"]["0"]["samples"]
    assert s["available"] and n >= 5 and s["seconds"] > 0
    assert not m._thread.is_alive() and not [t for t in threading.enumerate() if t.name == "nodus-gpumon"]
    assert nv.shutdowns == [1]
    s["gpus"].clear()  # the caller's copy, not the monitor's
    again = m.stop()
    assert again["gpus"]["0"]["samples"] == n and nv.served[0] == n and nv.shutdowns == [1]  # nothing sampled since


def test_without_nvml_stop_says_why_and_nothing_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # the import fails, as without nvidia-ml-py ...
    monkeypatch.setattr(gpumon, "_vllm_pynvml", lambda: (_ for _ in ()).throw(ImportError("no vllm package")))
    s = GpuMonitor().start().stop()  # ... and without vLLM's copy
    assert s["available"] is False and "no pynvml" in s["why"] and "vllm's copy" in s["why"]
    nv = fake_pynvml()
    nv.nvmlInit = lambda: (_ for _ in ()).throw(RuntimeError("NVMLError_DriverNotLoaded"))
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    s = GpuMonitor().start().stop()
    assert s == {"available": False, "why": "nvmlInit failed (RuntimeError: NVMLError_DriverNotLoaded)"}
    assert GpuMonitor(n_gpus=0).start().stop() == {"available": False, "why": "the run uses no GPU"}
    assert GpuMonitor().stop()["why"] == "never started"


def test_a_failing_call_ends_sampling_without_raising(monkeypatch):
    nv = fake_pynvml(fail="nvmlDeviceGetPowerUsage")  # fails at start's first sample
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    m = GpuMonitor(interval_s=0.005).start()
    assert m._thread is None and nv.shutdowns == [1]  # no thread started, NVML released
    assert m.stop() == {"available": False,
                        "why": "NVML call failed after 0 samples (RuntimeError: NVMLError_NotSupported)"}
    # In the thread: the driver stops answering after some samples.
    m, nv = sampling(monkeypatch, 3)
    nv.nvmlDeviceGetTemperature = lambda h, sensor: (_ for _ in ()).throw(RuntimeError("NVMLError_GpuIsLost"))
    m._thread.join(timeout=10)
    assert not m._thread.is_alive()  # the thread ended on its own
    s = m.stop()  # the samples before the failure stand, and the summary says where sampling ended
    n = s["gpus"]["0"]["samples"]
    assert s["available"] and n >= 3 and "NVMLError_GpuIsLost" in s["stopped_early"]
    assert f"after {n} samples" in s["stopped_early"]


def test_no_thread_to_be_had_says_why_releases_nvml_and_never_raises(monkeypatch):
    nv = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    m = GpuMonitor(interval_s=3600).start()
    assert m._thread is None and nv.shutdowns == [1]  # NVML released: no thread will sample with it
    assert m.stop() == {"available": False, "why": "cannot start the sampling thread (can't start new thread)"}
    assert m.stop()["why"].startswith("cannot start") and nv.shutdowns == [1]


def test_without_nvidia_ml_py_the_copy_vllm_ships_is_used(monkeypatch):
    """The H200 device bundle has vLLM's vendored pynvml and no nvidia-ml-py."""
    nv = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(gpumon, "_vllm_pynvml", lambda: nv)
    s = GpuMonitor(interval_s=0.01).start().stop()
    assert s["available"] and s["gpus"]["0"]["samples"] >= 1 and nv.shutdowns == [1]


def test_vllms_copy_loads_without_importing_vllm():
    """Importing vllm runs its env overrides (torch imported, TORCHINDUCTOR_COMPILE_THREADS=1):
    the copy is loaded from its file alone."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    code = ("import sys, os; from nodus.gpumon import _vllm_pynvml; m = _vllm_pynvml(); "
            "print(hasattr(m, 'nvmlInit'), 'vllm' in sys.modules, 'torch' in sys.modules, "
            "'TORCHINDUCTOR_COMPILE_THREADS' in os.environ)")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_COMPILE_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["True", "False", "False", "False"]


def test_a_binding_without_the_uuid_query_still_monitors(monkeypatch):
    """The UUID is optional: a binding that cannot answer it leaves it out, the figures stay."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    s = scripted(monkeypatch, fake_pynvml(fail="nvmlDeviceGetUUID"), len(SCRIPT))
    assert s["available"] and "uuid" not in s["gpus"]["0"] and s["gpus"]["0"]["samples"] == 10
