"""Fused element-wise pieces of a Qwen3 decoder for the trainer (torch.compile).

On the H200 the batched 8-adapter step went from 39.6k to 54.8k tokens/s with these compiled
(`experiments/results/h200/README.md`), and with the masked layout from 48.4k to 69.7k
(`experiments/results/h200/session3/`), the logprobs moving by at most 0.047 in bf16 (the
engine-vs-trainer agreement's size). On by default on a GPU (`--no-trainer-compile` turns it
off): compiling costs ~10-20 s at start-up, inside the untimed warm-up. Off on a CPU.
"""

from __future__ import annotations


def compile_wanted(flag: bool | None, device) -> bool:
    """Whether the trainer compiles: as asked, and by default (None) on a GPU only."""
    return flag if flag is not None else str(device).startswith("cuda")


def fuse_elementwise(model) -> list[str]:
    """torch.compile the memory-bound pieces of each decoder layer, leaving the matmuls (and the
    LoRA routing, whose per-step objects would make dynamo recompile) eager: RMSNorms, the rotary
    embedding and SiLU(gate) * up. Returns what was compiled."""
    import types

    import torch
    import torch.nn.functional as F
    from transformers.models.qwen3 import modeling_qwen3

    done = []
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    for m in norms:
        m.compile(dynamic=True)
    done.append(f"{len(norms)} RMSNorm")
    # Compiled once per process: a second trainer in the process (benchmarks build several) must
    # not wrap the compiled function again (a nest of compiled wrappers broke a CUDA graph capture).
    original = getattr(modeling_qwen3, "_nodus_rotary_eager", modeling_qwen3.apply_rotary_pos_emb)
    modeling_qwen3._nodus_rotary_eager = original
    modeling_qwen3.apply_rotary_pos_emb = torch.compile(original, dynamic=True)
    done.append("apply_rotary_pos_emb")
    silu_mul = torch.compile(lambda gate, up: F.silu(gate) * up, dynamic=True)

    def mlp_forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))

    mlps = [m for m in model.modules() if type(m).__name__ == "Qwen3MLP"]
    for m in mlps:
        m.forward = types.MethodType(mlp_forward, m)
    done.append(f"{len(mlps)} MLP silu*up")
    return done
