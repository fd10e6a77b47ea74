"""The trainer-to-engine adapter handoff without safetensors: one flat file a version.

A publish of the PEFT format costs both sides per tensor (~400 a rank-16 Qwen3-0.6B adapter): the
trainer splits its one device-to-host copy into a tensor each and safetensors writes them; vLLM's
loader opens the file, reads each tensor and pins each into page-locked memory (session 18's
profile: `get_tensor` and `pin_memory` the largest parts of the engine's 0.03 s an adapter). The
flat file is the trainer's copy as it is: a header (names, shapes, dtype) and the bytes, written in
one call; the engine reads it in one call into one buffer (page-locked once where vLLM pins) whose
views are the tensors, and hands them to vLLM's own `LoRAModel.from_lora_tensors`, the function
its PEFT loader ends in (the scaling fold, slots and eviction stay vLLM's).

The folder keeps PEFT's adapter_config.json (vLLM reads rank, alpha and targets from it); the
weights are `adapter_model.flat` instead of `adapter_model.safetensors`. A folder holds one or the
other. vLLM reads the flat file only in a process where `install_vllm_loader` ran: the engine
worker's own, with vLLM's engine core in it (nodus's default).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import struct
from pathlib import Path

# How the trainer hands a new adapter version to the engines: PEFT's safetensors folder, or the
# flat file (one write, one read; an engine that installed the loader below).
ADAPTER_FORMATS = ("safetensors", "flat")
FLAT_WEIGHTS = "adapter_model.flat"
MAGIC = b"NODUSLORA1"
DTYPES = ("float32", "bfloat16", "float16")


def host_copy(tensors: list["torch.Tensor"], dtype: "torch.dtype") -> "torch.Tensor":
    """The tensors, flattened and cast to ``dtype``, in one host buffer: on a GPU the concatenation
    and the cast run there, and one device-to-host copy (one wait) brings them over, where a copy
    per tensor would wait ~400 times an adapter."""
    import torch

    return torch.cat([t.detach().reshape(-1) for t in tensors]).to(dtype).cpu()


def write_flat(path: str | os.PathLike, names: list[str], tensors: list["torch.Tensor"],
               dtype: "torch.dtype") -> int:
    """Write the tensors, cast to ``dtype``, as one file; return its bytes. On a GPU the cast and
    the concatenation happen there, and one copy brings the bytes to the host. Written under a
    temporary name and renamed: a reader never sees half a file."""
    import torch

    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in DTYPES:
        raise ValueError(f"flat adapter dtype {dtype}: choose one of {DTYPES}")
    if len(names) != len(tensors) or not names:
        raise ValueError(f"flat adapter: {len(names)} names for {len(tensors)} tensors")
    flat = host_copy(tensors, dtype)
    header = json.dumps({"dtype": dtype_name,
                         "tensors": [[n, list(t.shape)] for n, t in zip(names, tensors)]}).encode()
    body = flat.view(torch.uint8).numpy()  # bytes of any dtype (numpy has no bfloat16)
    tmp = Path(path).with_name("." + Path(path).name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        f.write(memoryview(body))
    os.replace(tmp, path)
    return len(MAGIC) + 8 + len(header) + body.nbytes


def read_flat(path: str | os.PathLike, pin: bool = False) -> dict[str, "torch.Tensor"]:
    """The tensors of a flat file, each a view of one buffer read in one call (``pin``: a
    page-locked one). Each load has a buffer of its own: vLLM scales lora_B in place."""
    import torch

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(len(MAGIC))
        if magic != MAGIC:
            raise ValueError(f"{path}: not a nodus flat adapter (starts {magic!r}, expected {MAGIC!r})")
        (n_header,) = struct.unpack("<Q", f.read(8))
        try:
            header = json.loads(f.read(n_header))
            if header["dtype"] not in DTYPES:
                raise ValueError(f"dtype {header['dtype']!r} is none of {DTYPES}")
            dtype = getattr(torch, header["dtype"])
            entries = [(str(n), [int(d) for d in shape]) for n, shape in header["tensors"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: unreadable flat adapter header ({e})") from e
        n_body = size - len(MAGIC) - 8 - n_header
        buf = torch.empty(n_body, dtype=torch.uint8, pin_memory=pin)
        got = f.readinto(memoryview(buf.numpy()))
    want = sum(math.prod(shape) for _, shape in entries) * dtype.itemsize
    if got != n_body or want != n_body:
        raise ValueError(f"{path}: {n_body} bytes of weights (read {got}), its header describes {want}: "
                         "a truncated or foreign file")
    values = buf.view(dtype)
    out, offset = {}, 0
    for name, shape in entries:
        n = math.prod(shape)
        out[name] = values[offset:offset + n].view(shape)
        offset += n
    return out


_INSTALLED = False


def install_vllm_loader() -> None:
    """Teach vLLM's `LoRAModel.from_local_checkpoint` (in this process) to read a folder's flat file;
    folders without one load as before. Idempotent. Raises RuntimeError naming what this vLLM lacks
    where its loader is not the shape this wraps."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.lora import lora_model

    cls = lora_model.LoRAModel
    original = cls.from_local_checkpoint.__func__
    wraps = inspect.signature(original)
    accepted = set(inspect.signature(cls.from_lora_tensors).parameters)
    missing = ({"lora_dir", "expected_lora_modules", "peft_helper"} - set(wraps.parameters)) | (
        {"lora_model_id", "tensors", "peft_helper", "device", "dtype"} - accepted)
    if missing:
        raise RuntimeError(f"this vLLM's LoRAModel loaders lack {sorted(missing)}: the flat adapter format "
                           "cannot hand them tensors (use adapter_format='safetensors')")

    def from_local_checkpoint(klass, *args, **kwargs):
        bound = wraps.bind(klass, *args, **kwargs)
        bound.apply_defaults()
        given = dict(bound.arguments)
        flat = Path(given["lora_dir"]) / FLAT_WEIGHTS
        if not flat.is_file():
            return original(klass, *args, **kwargs)
        device = str(given.get("device", "cuda"))
        pin = device == "cpu" and bool(getattr(lora_model, "PIN_MEMORY", False))
        tensors = read_flat(flat, pin=pin)
        _check_modules(given["lora_dir"], tensors, given["expected_lora_modules"], given["peft_helper"],
                       given.get("weights_mapper"))
        if given.get("lora_model_id") is None:
            given["lora_model_id"] = lora_model.get_lora_id()
        given["tensors"] = tensors
        return klass.from_lora_tensors(**{k: v for k, v in given.items() if k in accepted and k != "cls"})

    cls.from_local_checkpoint = classmethod(from_local_checkpoint)
    _INSTALLED = True


_CHECKED: set = set()  # (names, allowed modules) already checked: a job's every version has the same names


def _check_modules(lora_dir, tensors: dict, expected: set[str], peft_helper, weights_mapper) -> None:
    """vLLM's own check of the PEFT path: every tensor's module one the model takes adapters on."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    extra = set(getattr(peft_helper, "modules_to_save", None) or ())
    # The mapper (vLLM makes one per load) by its contents: its rename rules.
    key = (tuple(tensors), frozenset(expected | extra), repr(weights_mapper))
    if key in _CHECKED:
        return
    bad = []
    for name in tensors:
        module, _ = parse_fine_tuned_lora_name(name, weights_mapper)
        if module.rsplit(".", 1)[-1] not in expected | extra:
            bad.append(module)
    if bad:
        raise ValueError(f"While loading {lora_dir}, expected target modules in {sorted(expected)} "
                         f"but received {bad[:5]}{' ...' if len(bad) > 5 else ''}")
    _CHECKED.add(key)


def export_peft(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """The adapter folder ``src`` (either format) as a PEFT folder at ``dst`` (adapter_config.json +
    adapter_model.safetensors: ``PeftModel.from_pretrained`` and vLLM load it), written under a
    temporary name and renamed. Refuses a ``dst`` that exists: a run's deliverable is never overwritten."""
    import shutil

    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst}: an adapter is already there (adapters are never overwritten)")
    tmp = dst.with_name("." + dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if (src / FLAT_WEIGHTS).is_file():
        from safetensors.torch import save_file

        tmp.mkdir(parents=True)
        # Each tensor its own storage: safetensors refuses views of one buffer.
        tensors = {k: v.clone() for k, v in read_flat(src / FLAT_WEIGHTS).items()}
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        shutil.copy(src / "adapter_config.json", tmp / "adapter_config.json")
    else:
        shutil.copytree(src, tmp)
    os.replace(tmp, dst)
    return dst
