"""Many jobs' LoRA adapters over one frozen base model, applied row by row in one shared batch.

Each target ``nn.Linear`` is wrapped by ``MultiLoRALinear``, which computes
``base(x) + bmm(bmm(x_j, A_j^T) * scale_j, B_j^T)`` for every job j of the micro-batch at once.
The base matmul sees all rows (one big GEMM); the adapter matmuls are two ``bmm`` over a
[jobs, rows_per_job * T, d] view of the batch, which is why rows are laid out job-major.

Per step the jobs' adapters are copied into per-module stacks (``AdapterStack``): leaf tensors
[J, r_max, d_in] and [J, d_out, r_max] that all micro-batches of the step read, and whose grads are
split back onto each job's own parameters afterwards. Jobs of different ranks are zero-padded to
the step's largest rank: a zero row of A and the matching zero column of B add exactly 0 to the
output, and their gradients are (B_pad^T g) x = 0 and g (x A_pad^T) = 0, so nothing leaks between
real and padded parts; the padded slices are dropped when the grads are split back. (Grouping by
rank would save the padded FLOPs, which are small next to the base's.)

``save_peft_adapter`` writes one job's adapter in PEFT's on-disk format (key names
``base_model.model.<module>.lora_A.weight``), which PEFT and vLLM's LoRARequest both load.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch
from torch import nn

DEFAULT_TARGET_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Adapter:
    """One job's LoRA weights: per target module, A [rank, d_in] and B [d_out, rank] (PEFT layout)."""

    rank: int
    alpha: float
    A: dict[str, nn.Parameter] = field(default_factory=dict)
    B: dict[str, nn.Parameter] = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def parameters(self) -> list[nn.Parameter]:
        return [p for name in self.A for p in (self.A[name], self.B[name])]


def init_adapter(shapes: dict[str, tuple[int, int]], rank: int, alpha: float,
                 generator: torch.Generator, device: torch.device | str,
                 dtype: torch.dtype = torch.float32) -> Adapter:
    """PEFT's default LoRA init: A kaiming-uniform(a=sqrt(5)) like nn.Linear, B zeros, so the
    adapted model starts exactly at the base model. ``shapes`` maps module -> (d_in, d_out)."""
    adapter = Adapter(rank=rank, alpha=alpha)
    for name, (d_in, d_out) in shapes.items():
        a = torch.empty(rank, d_in, dtype=torch.float32)
        # Drawn on CPU in fp32 so a seed gives the same adapter on every device and dtype.
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        adapter.A[name] = nn.Parameter(a.to(device=device, dtype=dtype))
        adapter.B[name] = nn.Parameter(torch.zeros(d_out, rank, device=device, dtype=dtype))
    return adapter


class AdapterStack:
    """The adapters of one step, stacked per module into leaf tensors all micro-batches share."""

    def __init__(self, adapters: list[Adapter], requires_grad: bool):
        self.adapters = adapters
        self.max_rank = max(a.rank for a in adapters)
        first = adapters[0]
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        for name in first.A:
            self.A[name] = _stack([a.A[name] for a in adapters], self.max_rank, dim=0).requires_grad_(requires_grad)
            self.B[name] = _stack([a.B[name] for a in adapters], self.max_rank, dim=1).requires_grad_(requires_grad)
        p = first.A[next(iter(first.A))]
        self.scaling = torch.tensor([a.scaling for a in adapters], dtype=p.dtype, device=p.device)

    def write_grads(self) -> None:
        """Give each job's parameters their slice of the stacks' grads (zeros if none flowed)."""
        give_slot_grads(self.adapters, {n: t.grad for n, t in self.A.items()},
                        {n: t.grad for n, t in self.B.items()}, copy=False)


def give_slot_grads(adapters: list[Adapter], grad_A: dict, grad_B: dict, copy: bool) -> None:
    """Adapter j's parameters get slot j of per-module stacked grads (A [J, r_max, d_in], B
    [J, d_out, r_max]; rank-padded columns dropped; a None stack: zeros). ``copy``: each grad its
    own storage, for stacks that are reused (otherwise a slice may be a view of the stack)."""
    for j, a in enumerate(adapters):
        for name in a.A:
            for params, stack, part in ((a.A, grad_A[name], (j, slice(0, a.rank))),
                                        (a.B, grad_B[name], (j, slice(None), slice(0, a.rank)))):
                if stack is None:
                    params[name].grad = torch.zeros_like(params[name])
                else:
                    g = stack[part]
                    params[name].grad = g.clone(memory_format=torch.contiguous_format) if copy else g.contiguous()


def _stack(tensors: list[torch.Tensor], max_rank: int, dim: int) -> torch.Tensor:
    if all(t.shape[dim] == max_rank for t in tensors):
        return torch.stack([t.detach() for t in tensors])
    shape = list(tensors[0].shape)
    shape[dim] = max_rank
    out = tensors[0].new_zeros([len(tensors)] + shape)
    for j, t in enumerate(tensors):
        out[j].narrow(dim, 0, t.shape[dim]).copy_(t.detach())
    return out


@dataclass(frozen=True)
class RowLayout:
    """Which adapter each row of a job-major micro-batch uses."""

    num_rows: int  # rows (sequences) in the micro-batch
    slots: torch.Tensor | None  # [J_mb] indices into the step's stack, in row order; None: all, in order
    rows_per_slot: int  # rows per job after padding every job to the same count
    dest_rows: torch.Tensor | None  # [num_rows] padded-row index of each row; None: no padding needed
    local_slot: torch.Tensor | None = None  # [num_rows] each row's job among the micro-batch's J_mb
    num_local: int = 1  # J_mb: distinct jobs in the micro-batch

    def to(self, put) -> "RowLayout":
        """The same layout with its index tensors passed through ``put`` (e.g. to a device)."""
        opt = (lambda t: None if t is None else put(t))
        return RowLayout(self.num_rows, opt(self.slots), self.rows_per_slot, opt(self.dest_rows),
                         opt(self.local_slot), self.num_local)


def make_row_layout(slot_of_row: list[int], device: torch.device | str, num_slots: int) -> RowLayout:
    """Layout for rows whose stack slots are given in job-major order (non-decreasing)."""
    if any(b < a for a, b in zip(slot_of_row, slot_of_row[1:])):
        raise ValueError("rows must be job-major: slot_of_row must be non-decreasing")
    present = sorted(set(slot_of_row))
    counts = [slot_of_row.count(s) for s in present]
    per_slot = max(counts)
    slots = None if present == list(range(num_slots)) else torch.tensor(present, device=device)
    dest = None
    if any(c != per_slot for c in counts):
        # Jobs with fewer rows get zero rows in the adapter path only; the base never sees them.
        idx = []
        for k, c in enumerate(counts):
            idx.extend(range(k * per_slot, k * per_slot + c))
        dest = torch.tensor(idx, device=device)
    local = torch.tensor([present.index(k) for k in slot_of_row], device=device)
    return RowLayout(num_rows=len(slot_of_row), slots=slots, rows_per_slot=per_slot, dest_rows=dest,
                     local_slot=local, num_local=len(present))


LORA_LAYOUTS = ("auto", "masked", "padded")
# "auto" takes the masked path in a layer while the micro-batch's adapters span at most this
# fraction of the layer's input width in rank columns (the masked path's extra FLOPs).
AUTO_MASKED_MAX_FRACTION = 1 / 8


class Routing:
    """Mutable state shared by all wrapped layers: the active stack and row layout (None: base only).

    It stays set through backward, so recomputation under gradient checkpointing sees it too.
    ``layout_mode`` picks how rows reach their adapters (see ``lora_delta`` and ``lora_delta_masked``).
    """

    def __init__(self, layout_mode: str = "masked"):
        if layout_mode not in LORA_LAYOUTS:
            raise ValueError(f"lora_layout={layout_mode!r}; expected one of {LORA_LAYOUTS}")
        self.layout_mode = layout_mode
        self.stack: AdapterStack | None = None
        self._layout: RowLayout | None = None
        self._coef: dict = {}
        self.mixed_masked = False  # set once a micro-batch of several adapters took the masked path

    @property
    def layout(self) -> RowLayout | None:
        return self._layout

    @layout.setter
    def layout(self, layout: RowLayout | None) -> None:
        self._layout = layout
        self._coef = {}

    def masked(self, d_in: int) -> bool:
        """Whether this micro-batch takes the masked path in a layer of input width ``d_in``."""
        if self.layout_mode != "auto":
            masked = self.layout_mode == "masked"
        else:
            masked = self._layout.num_local * self.stack.max_rank <= AUTO_MASKED_MAX_FRACTION * d_in
        self.mixed_masked |= masked and self._layout.num_local > 1
        return masked

    def coef(self, scaling: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[rows, 1, J_mb * r]: each row's own job's scale on its own rank columns, 0 elsewhere.
        The same for every wrapped layer of the micro-batch, so built once."""
        key = dtype
        if key not in self._coef:
            lay, r = self._layout, self.stack.max_rank
            local = lay.local_slot
            coef = scaling.new_zeros(lay.num_rows, lay.num_local, r)
            coef[torch.arange(lay.num_rows, device=local.device), local] = scaling[local].to(coef.dtype)[:, None]
            self._coef[key] = coef.reshape(lay.num_rows, 1, lay.num_local * r).to(dtype)
        return self._coef[key]


def lora_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: torch.Tensor,
               layout: RowLayout) -> torch.Tensor:
    """Each row's own job's adapter output, scale_j * x A_j^T B_j^T, for job-major x
    [rows, ..., d_in], A [J, r, d_in], B [J, d_out, r], scaling [J]: two bmm over all jobs."""
    d_in = x.shape[-1]
    xs = x.reshape(layout.num_rows, -1, d_in)
    tokens_per_row = xs.shape[1]
    J = A.shape[0]
    if layout.dest_rows is not None:
        xs = xs.new_zeros(J * layout.rows_per_slot, tokens_per_row, d_in).index_copy(0, layout.dest_rows, xs)
    xj = xs.reshape(J, layout.rows_per_slot * tokens_per_row, d_in)
    h = torch.bmm(xj, A.to(x.dtype).transpose(1, 2)) * scaling.to(x.dtype)[:, None, None]
    out = torch.bmm(h, B.to(x.dtype).transpose(1, 2))
    out = out.reshape(J * layout.rows_per_slot, tokens_per_row, -1)
    if layout.dest_rows is not None:
        out = out.index_select(0, layout.dest_rows)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def lora_delta_masked(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      coef: torch.Tensor) -> torch.Tensor:
    """y + each row's own adapter output, without regrouping rows: x [rows, ..., d_in] times every
    micro-batch adapter's A at once (A [J, r, d_in] as one [J*r, d_in] matrix), each row's columns
    of the other adapters zeroed and its own scaled by ``coef`` [rows, 1, J*r], then one GEMM with
    every B side by side ([d_out, J*r]) accumulated onto y. Dense GEMMs with J*r inner columns and
    no copies of x, against ``lora_delta``'s padded [J, rows, d] regrouping. The zeroed columns add
    exactly 0 to a row's output and, for finite values, no gradient to the other adapters; a
    non-finite gradient reaches them as 0 * nan (the trainer redoes such a step on the padded path)."""
    J, r, d_in = A.shape
    h = torch.matmul(x, A.to(x.dtype).reshape(J * r, d_in).t())
    h = h.reshape(coef.shape[0], -1, J * r) * coef
    Bm = B.to(x.dtype).permute(1, 0, 2).reshape(B.shape[1], J * r)
    out = torch.addmm(y.reshape(-1, y.shape[-1]), h.reshape(-1, J * r), Bm.t())
    return out.reshape(y.shape)


class MultiLoRALinear(nn.Module):
    """A frozen nn.Linear plus, per row, the adapter of that row's job (see ``Routing``)."""

    def __init__(self, base_layer: nn.Linear, name: str, routing: Routing):
        super().__init__()
        self.base_layer = base_layer
        self.name = name
        self.routing = routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        stack, layout = self.routing.stack, self.routing.layout
        if stack is None:
            return y
        A, B, scaling = stack.A[self.name], stack.B[self.name], stack.scaling
        if layout.slots is not None:
            A, B, scaling = A.index_select(0, layout.slots), B.index_select(0, layout.slots), scaling[layout.slots]
        if self.routing.masked(x.shape[-1]):
            return lora_delta_masked(x, y, A, B, self.routing.coef(scaling, x.dtype))
        return y + lora_delta(x, A, B, scaling, layout)


def wrap_linears(model: nn.Module, target_modules: tuple[str, ...], routing: Routing) -> dict[str, tuple[int, int]]:
    """Replace every nn.Linear whose last name part is a target by a MultiLoRALinear, in place.
    Returns module name -> (d_in, d_out), in model order (names as PEFT's keys use them)."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] not in target_modules or not isinstance(module, nn.Linear):
            continue
        if module.bias is not None:
            raise ValueError(f"{name} has a bias; LoRA over biased linears is not supported here")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MultiLoRALinear(module, name, routing))
        shapes[name] = (module.in_features, module.out_features)
    if not shapes:
        raise ValueError(f"no nn.Linear named any of {target_modules} in the model")
    return shapes


def _peft_tensors(adapter: Adapter) -> tuple[list[str], list[torch.Tensor]]:
    """PEFT's saved key names (base_model.model.<module>.lora_{A,B}.weight, no adapter name) and
    the adapter's tensors, in that order."""
    names, tensors = [], []
    for name in adapter.A:
        names += [f"base_model.model.{name}.lora_A.weight", f"base_model.model.{name}.lora_B.weight"]
        tensors += [adapter.A[name].detach(), adapter.B[name].detach()]
    return names, tensors


def peft_state_dict(adapter: Adapter, dtype: torch.dtype = torch.float32,
                    one_copy: bool | None = None) -> dict[str, torch.Tensor]:
    """PEFT's saved key names: base_model.model.<module>.lora_{A,B}.weight (no adapter name).

    On a GPU every tensor goes to the host in one copy (one flat buffer, cast to ``dtype`` on the
    device): a copy per tensor would wait on the GPU ~400 times per adapter. ``one_copy`` forces
    either way (default: on a GPU)."""
    names, tensors = _peft_tensors(adapter)
    if not (one_copy if one_copy is not None else tensors[0].device.type != "cpu"):
        return {n: t.to("cpu", dtype).contiguous() for n, t in zip(names, tensors)}
    from real.flat_adapter import host_copy

    flat = host_copy(tensors, dtype)
    out, offset = {}, 0
    for n, t in zip(names, tensors):
        # Each its own storage: safetensors refuses tensors that share memory.
        out[n] = flat[offset:offset + t.numel()].view(t.shape).clone()
        offset += t.numel()
    return out


def save_peft_adapter(adapter: Adapter, path: str | os.PathLike, target_modules: tuple[str, ...],
                      base_model_name_or_path: str | None = None, dtype: torch.dtype = torch.float32) -> None:
    """Write adapter_config.json + adapter_model.safetensors as ``PeftModel.save_pretrained`` does."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = peft_config(adapter, target_modules, base_model_name_or_path)
    # Write to temporary names and rename, so a reader (the engine) never sees half a file.
    tmp_w = os.path.join(path, ".adapter_model.safetensors.tmp")
    save_file(peft_state_dict(adapter, dtype), tmp_w, metadata={"format": "pt"})
    os.replace(tmp_w, os.path.join(path, "adapter_model.safetensors"))
    _write_config(path, config)


def peft_config(adapter: Adapter, target_modules: tuple[str, ...], base_model_name_or_path: str | None) -> dict:
    """adapter_config.json as ``PeftModel.save_pretrained`` writes it for a plain LoRA."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.rank, "lora_alpha": adapter.alpha,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n in adapter.A} & set(target_modules)),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path, "rank_pattern": {}, "alpha_pattern": {},
    }


def save_flat_adapter(adapter: Adapter, path: str | os.PathLike, target_modules: tuple[str, ...],
                      base_model_name_or_path: str | None = None, dtype: torch.dtype = torch.float32) -> None:
    """adapter_config.json + adapter_model.flat (real/flat_adapter.py): the engine's fast handoff,
    the same tensors under the same names as ``save_peft_adapter``'s file."""
    from real.flat_adapter import FLAT_WEIGHTS, write_flat

    os.makedirs(path, exist_ok=True)
    write_flat(os.path.join(path, FLAT_WEIGHTS), *_peft_tensors(adapter), dtype)
    _write_config(path, peft_config(adapter, target_modules, base_model_name_or_path))


def _write_config(path: str | os.PathLike, config: dict) -> None:
    tmp = os.path.join(path, ".adapter_config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, os.path.join(path, "adapter_config.json"))
