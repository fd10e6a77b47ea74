"""Tuned configs for vLLM's multi-LoRA Triton kernels (shrink, expand), shipped per GPU.

vLLM runs its LoRA kernels with generic block sizes unless ``VLLM_TUNED_CONFIG_FOLDER`` names a
folder holding ``{GPU}_SHRINK.json`` and ``{GPU}_EXPAND_TRUE.json`` for the GPU it runs on (the
name as ``torch.cuda.get_device_name()`` gives it, spaces and dashes as underscores). The project
ships such a folder (``real/lora_configs/``, written by ``experiments/tune_lora_kernels.py`` on
the GPU it names; its per-shape report beside it): on the H200, for the Qwen3-0.6B shape at rank
16, each kernel 1.0-3.0x faster than vLLM's default config, never slower (session 11,
``experiments/results/h200/session11/``).

An engine uses them by default when they exist for its GPU and were tuned for its LoRA shapes
(the model's projection widths and the engine's max LoRA rank, from ``{GPU}_REPORT.json``: vLLM
takes the nearest tuned width and rank for any other, which may be slower than its default). The
shipped H200 configs were tuned for 8 adapter slots (the 8-job arms); an engine with other slot
counts gets the nearest (vLLM's lookup), not measured against vLLM's default there. A
``VLLM_TUNED_CONFIG_FOLDER`` the user set (or ``--engine-env``) wins; ``tuned=False`` (``--no-tuned-lora-kernels``) runs vLLM's
defaults. The choice is recorded with every run (the engine worker's start info) and every
calibrated profile (its environment header), so the simulator can tell which engine it describes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "VLLM_TUNED_CONFIG_FOLDER"
SHIPPED_DIR = Path(__file__).resolve().parent / "lora_configs"


def vllm_gpu_name(device_name: str) -> str:
    """The GPU's name as vLLM spells it in config file names ("NVIDIA H200" -> "NVIDIA_H200")."""
    return device_name.replace(" ", "_").replace("-", "_")


def config_files(device_name: str) -> dict[str, str]:
    """The file vLLM reads for each op on this GPU (``load_lora_op_config``)."""
    gpu = vllm_gpu_name(device_name)
    return {"shrink": f"{gpu}_SHRINK.json", "expand": f"{gpu}_EXPAND_TRUE.json"}


def report_file(device_name: str) -> str:
    """The tuner's report beside the configs: what they were tuned for (rank, shapes)."""
    return f"{vllm_gpu_name(device_name)}_REPORT.json"


def lora_shapes(config: dict) -> dict[str, list[tuple]]:
    """The LoRA kernel calls of one decoder layer as vLLM makes them for a Qwen3/Llama-style model
    with every linear layer adapted: shrink (num_slices, input width) and expand (output widths of
    the slices). q/k/v are one layer of 3 slices, gate/up one of 2."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"shrink": [(3, hidden), (1, q), (2, hidden), (1, inter)],
            "expand": [(q, kv, kv), (hidden,), (inter, inter), (hidden,)]}


def _as_lists(shapes: dict) -> dict:
    return {op: [list(s) for s in v] for op, v in shapes.items()}


def shipped_folder(device_name: str, rank: int, model_config: dict | None,
                   folder: Path = SHIPPED_DIR) -> Path | None:
    """``folder`` when it holds both config files for this GPU and its report says they were tuned
    for this rank and these LoRA shapes; else None."""
    report = folder / report_file(device_name)
    if model_config is None or not report.is_file() or not all((folder / f).is_file()
                                                               for f in config_files(device_name).values()):
        return None
    try:
        tuned = json.loads(report.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{report}: not valid JSON ({err}); reinstall nodus or run with --no-tuned-lora-kernels") from err
    try:
        same = tuned.get("rank") == rank and _as_lists(tuned.get("shapes") or {}) == _as_lists(lora_shapes(model_config))
    except (KeyError, TypeError):  # a config without the fields lora_shapes reads: not a match
        return None
    return folder if same else None


def model_config(model: str | os.PathLike) -> dict | None:
    """A local model folder's config.json (None for a hub name or a folder without one)."""
    path = Path(model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def choose(tuned: bool, device_name: str | None, rank: int, config: dict | None, environ=os.environ,
           folder: Path = SHIPPED_DIR) -> dict | None:
    """Which LoRA kernel configs an engine about to start will use, setting ``VLLM_TUNED_CONFIG_FOLDER``
    in ``environ`` when the shipped ones apply. Returns what to record: None for vLLM's defaults,
    else {"source": "env" | "shipped", "folder", "gpu"}. ``device_name``: the CUDA device's name
    (None: no CUDA device, where vLLM's LoRA kernels are not Triton ones); ``rank``: the engine's
    max LoRA rank; ``config``: the model's config.json."""
    if environ.get(ENV):
        return {"source": "env", "folder": environ[ENV], "gpu": device_name}
    if not tuned or device_name is None:
        return None
    found = shipped_folder(device_name, rank, config, folder)
    if found is None:
        return None
    environ[ENV] = str(found)
    return {"source": "shipped", "folder": str(found), "gpu": device_name}


def cuda_device_name() -> str | None:
    """The current CUDA device's name, None without one (no torch import cost beyond vLLM's own)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def m_buckets(folder: str | os.PathLike | None, device_name: str | None) -> list[int]:
    """The token counts (``m``) the tuned configs in ``folder`` are keyed by for this GPU: vLLM
    runs a step of M tokens with the config of the nearest key, each config its own Triton
    compile. [] without a folder or its files (vLLM then runs its default config, which changes
    at 128 tokens a step: ``real.engine.DEFAULT_CONFIG_EDGES``)."""
    if not folder or not device_name:
        return []
    keys: set[int] = set()
    for name in config_files(device_name).values():
        path = Path(folder) / name
        if not path.is_file():
            continue
        # config[max_loras][num_slices][m][k][n]
        for by_slices in json.loads(path.read_text()).values():
            for by_m in by_slices.values():
                keys.update(int(m) for m in by_m)
    return sorted(keys)
