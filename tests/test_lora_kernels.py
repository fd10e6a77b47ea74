"""The tuned LoRA kernel configs nodus ships (real/lora_configs/, real/lora_kernels.py): which
engines use them, that an explicit choice wins, and that vLLM's own lookup reads them."""

import json

import pytest

from real.lora_kernels import ENV, SHIPPED_DIR, choose, lora_shapes, model_config, shipped_folder

QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128}


def test_shipped_configs_apply_to_their_gpu_rank_and_shapes_only():
    assert shipped_folder("NVIDIA H200", 16, QWEN3_06B) == SHIPPED_DIR
    assert shipped_folder("NVIDIA H100 80GB HBM3", 16, QWEN3_06B) is None  # another GPU: none shipped
    assert shipped_folder("NVIDIA H200", 64, QWEN3_06B) is None  # tuned at rank 16
    assert shipped_folder("NVIDIA H200", 16, dict(QWEN3_06B, hidden_size=2048)) is None  # another model
    assert shipped_folder("NVIDIA H200", 16, None) is None  # a hub name: its shapes are unknown here
    assert shipped_folder("NVIDIA H200", 16, {"model_type": "bert"}) is None  # no fields to match


def test_choice_is_recorded_and_an_explicit_folder_or_opt_out_wins(tmp_path):
    env = {}
    got = choose(True, "NVIDIA H200", 16, QWEN3_06B, environ=env)
    assert got == {"source": "shipped", "folder": str(SHIPPED_DIR), "gpu": "NVIDIA H200"}
    assert env == {ENV: str(SHIPPED_DIR)}
    env = {ENV: str(tmp_path)}  # the user's own folder (--engine-env) is kept
    assert choose(True, "NVIDIA H200", 16, QWEN3_06B, environ=env)["source"] == "env"
    assert env == {ENV: str(tmp_path)}
    for args in ((False, "NVIDIA H200"), (True, None), (True, "NVIDIA A100-SXM4-80GB")):
        env = {}
        assert choose(*args, 16, QWEN3_06B, environ=env) is None and env == {}


def test_model_config_reads_a_local_folder_only(tmp_path):
    assert model_config("Qwen/Qwen3-0.6B") is None
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    assert lora_shapes(model_config(tmp_path)) == lora_shapes(QWEN3_06B)


def test_shipped_report_covers_the_engine_shapes_and_never_slower():
    report = json.loads((SHIPPED_DIR / "NVIDIA_H200_REPORT.json").read_text())
    rows = report["rows"]
    assert rows and all(r["best_us"] <= r["default_us"] for r in rows)
    assert {(r["op"], r["slices"]) for r in rows} == {("shrink", 1), ("shrink", 2), ("shrink", 3),
                                                      ("expand", 1), ("expand", 2), ("expand", 3)}


def test_vllm_reads_the_shipped_configs_for_every_engine_lookup(monkeypatch):
    """Through vLLM's own lookup, as the engine of an 8-job run makes it (9 lora slots with the
    no-adapter one): a tuned entry at every batch the engine runs, other slot counts the nearest."""
    pytest.importorskip("vllm")
    import torch
    import vllm.lora.ops.triton_ops.utils as u

    from experiments.tune_lora_kernels import key_width

    monkeypatch.setenv(ENV, str(SHIPPED_DIR))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    u.load_lora_op_config.cache_clear()
    u.get_lora_op_configs.cache_clear()
    tables = {op: json.loads((SHIPPED_DIR / name).read_text())
              for op, name in (("shrink", "NVIDIA_H200_SHRINK.json"), ("expand", "NVIDIA_H200_EXPAND_TRUE.json"))}
    try:
        for op, shapes in lora_shapes(QWEN3_06B).items():
            for shape in shapes:
                slices, k, n = key_width(op, shape, 16)
                for loras in (3, 9, 17):
                    for m in (1, 100, 512, 8192):
                        got = u.get_lora_op_configs(op, max_loras=loras, batch=m,
                                                    hidden_size=k if op == "shrink" else n,
                                                    rank=n if op == "shrink" else k, num_slices=slices,
                                                    **({"add_inputs": True} if op == "expand" else {}))
                        by_m = tables[op]["9"][str(slices)]
                        near = min(by_m, key=lambda b: abs(int(b) - m))
                        assert got == by_m[near][str(k)][str(n)]
    finally:
        u.load_lora_op_config.cache_clear()
        u.get_lora_op_configs.cache_clear()


def test_a_damaged_shipped_report_is_a_clear_error(tmp_path):
    for name in ("NVIDIA_H200_SHRINK.json", "NVIDIA_H200_EXPAND_TRUE.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "NVIDIA_H200_REPORT.json").write_text('{"rank": 16, ')
    with pytest.raises(ValueError, match="NVIDIA_H200_REPORT.json: not valid JSON"):
        shipped_folder("NVIDIA H200", 16, QWEN3_06B, tmp_path)
    (tmp_path / "NVIDIA_H200_REPORT.json").write_text(json.dumps({"rank": 16, "shapes": lora_shapes(QWEN3_06B)}))
    assert shipped_folder("NVIDIA H200", 16, QWEN3_06B, tmp_path) == tmp_path


def test_a_profile_names_the_kernels_its_engine_terms_describe():
    from sim.profile import Profile, profile_dict, profile_lora_kernels

    prof = profile_dict("h200-xeon16-qwen3-0.6b")
    assert profile_lora_kernels(prof) == "default"  # measured before the shipped configs
    tuned = dict(prof, environment=dict(prof["environment"], lora_kernel_configs={
        "source": "shipped", "folder": "real/lora_configs", "gpu": "NVIDIA H200"}))
    assert profile_lora_kernels(tuned) == "tuned"
    Profile.model_validate(tuned)  # the field belongs to the profile format


def _kind(m: int, keys: list[int], edges: tuple = (), rank: int = 16) -> tuple:
    """What a step of m tokens compiles its LoRA kernels for: the config vLLM looks up (the nearest
    tuned key, its get_lora_op_configs; without keys its default, which changes at each edge) and
    Triton's integer specialisations (1, multiples of 16) of m and of the shrink buffer's stride
    m * rank."""
    config = min(keys, key=lambda k: abs(k - m)) if keys else sum(m >= e for e in edges)
    return config, m == 1, m % 16 == 0, (m * rank) % 16 == 0


@pytest.mark.parametrize("graph_max,max_batched,keys,edges,rank", [
    (512, 16384, [1, 16, 64, 256, 512, 8192], (), 16),
    (1024, 16384, [1, 16, 64, 256, 512, 8192], (), 16),
    (None, 8192, [1, 16, 64, 256, 512, 8192], (), 16),
    (None, 4096, [], (128,), 16),  # vLLM's default config: split_k / block_k change at 128 tokens
    (64, 4096, [], (128,), 16),
    (512, 16384, [1, 16, 64, 256, 512, 8192], (), 8),  # rank 8: the stride m * 8 splits the odd/even
    (None, 3000, [], (128,), 4),
    (512, 2048, [1, 64, 3000], (), 16),
])
def test_warm_up_step_sizes_cover_every_kind_of_eager_step(graph_max, max_batched, keys, edges, rank):
    """Every token count an eager step can have (past the largest CUDA graph, up to the most tokens
    one step holds) compiles a kind the warm-up's counts compile too, with one count of each kind."""
    from real.engine import warmup_token_counts

    counts = warmup_token_counts(graph_max, max_batched, keys, edges, rank)
    lo = (graph_max or 0) + 1
    assert all(lo <= m <= max_batched for m in counts)
    every = {_kind(m, keys, edges, rank) for m in range(lo, max_batched + 1)}
    assert {_kind(m, keys, edges, rank) for m in counts} == every
    assert len(counts) == len(every)


def test_warm_up_needs_no_steps_when_graphs_cover_the_budget():
    from real.engine import warmup_token_counts

    assert warmup_token_counts(1024, 1024, [512]) == []


def test_m_buckets_reads_the_shipped_configs_token_keys(tmp_path):
    from real.lora_kernels import m_buckets

    assert m_buckets(SHIPPED_DIR, "NVIDIA H200") == [1, 16, 64, 256, 512, 8192]
    assert m_buckets(tmp_path, "NVIDIA H200") == [] and m_buckets(None, "NVIDIA H200") == []
