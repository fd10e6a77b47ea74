"""experiments/tune_lora_kernels.py without a GPU: the shapes it tunes, its search space, and the
config folder it writes, read back through vLLM's own lookup for every call the engine makes."""

import pytest

from experiments.tune_lora_kernels import (QWEN3_06B, complete, key_width, lora_shapes, put, search_space,
                                           write_configs)


def test_qwen3_06b_lora_calls_as_vllm_slices_them():
    shapes = lora_shapes(QWEN3_06B)
    assert shapes["shrink"] == [(3, 1024), (1, 2048), (2, 1024), (1, 3072)]  # qkv, o, gate/up, down inputs
    assert shapes["expand"] == [(2048, 1024, 1024), (1024,), (3072, 3072), (1024,)]  # their outputs
    assert key_width("expand", (2048, 1024, 1024), 16) == (3, 16, 2048)  # vLLM keys by the widest slice
    assert key_width("shrink", (1, 3072), 16) == (1, 3072, 16)


def test_search_space_fits_the_shapes():
    for width in (1024, 2048, 3072):
        shrink = search_space("shrink", 16, width)
        assert shrink and all(c["block_k"] * c["split_k"] <= width and c["block_n"] == 16 for c in shrink)
    expand = search_space("expand", 16, 1024)
    assert expand and all(c["block_k"] == 16 and c["block_n"] <= 1024 for c in expand)


def test_written_configs_answer_every_lookup_the_engine_makes(tmp_path, monkeypatch):
    """A tuning cut short (only the q/k/v shrink at two batch sizes) still gives vLLM an entry for
    every slice count it indexes exactly; the tuned entries win at their batch sizes and the
    nearest batch; the rest are vLLM's defaults."""
    pytest.importorskip("vllm")
    import torch
    import vllm.lora.ops.triton_ops.utils as u

    shapes = lora_shapes(QWEN3_06B)
    tuned = {"block_m": 16, "block_n": 16, "block_k": 128, "split_k": 8, "num_warps": 4, "num_ctas": 1,
             "num_stages": 2, "group_size_m": 8}
    tables = {"shrink": {}, "expand": {}}
    for m in (64, 256):
        put(tables["shrink"], 9, 3, m, 1024, 16, dict(tuned, block_m=m // 4))

    def default(op, key, slices, k, n):
        return {"block_m": 1, "block_n": 2, "block_k": 3, "split_k": 4, "num_warps": 4, "num_ctas": 1,
                "num_stages": 2, "op": op, "slices": slices}

    complete(tables, shapes, 16, [9], default)
    paths = write_configs(tmp_path, "NVIDIA H200", tables)
    assert sorted(p.name for p in paths) == ["NVIDIA_H200_EXPAND_TRUE.json", "NVIDIA_H200_SHRINK.json"]
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    u.load_lora_op_config.cache_clear()
    u.get_lora_op_configs.cache_clear()
    try:
        assert u.get_lora_op_configs("shrink", max_loras=9, batch=256, hidden_size=1024, rank=16,
                                     num_slices=3)["block_m"] == 64
        assert u.get_lora_op_configs("shrink", max_loras=9, batch=80, hidden_size=1024, rank=16,
                                     num_slices=3)["block_m"] == 16  # nearest tuned batch: 64
        for op, op_shapes in shapes.items():
            for shape in op_shapes:
                slices, k, n = key_width(op, shape, 16)
                for m in (1, 200, 8192):
                    got = u.get_lora_op_configs(op, max_loras=9, batch=m, hidden_size=k if op == "shrink" else n,
                                                rank=n if op == "shrink" else k, num_slices=slices,
                                                **({"add_inputs": True} if op == "expand" else {}))
                    assert got["block_m"] in (1, 16, 64)
                    if not (op == "shrink" and slices == 3):
                        assert got == default(op, 9, slices, k, n)
    finally:
        u.load_lora_op_config.cache_clear()
        u.get_lora_op_configs.cache_clear()
