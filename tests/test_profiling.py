"""The profile summary's arithmetic (real/profiling.py), without a GPU."""

from types import SimpleNamespace

from real.profiling import is_annotation, kernel_groups, kernel_kind, union_us, unique_kernels


def event(name, start, end, annotation=False):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                           is_user_annotation=annotation)


def test_a_kernel_listed_twice_counts_once_and_labels_are_not_kernels():
    # microseconds
    events = [event("nvjet_sm90_tst_256x128", 0, 1000), event("nvjet_sm90_tst_256x128", 0, 1000),
              event("triton_poi_fused_mul_silu_0", 1200, 1500), event("nodus.forward", 0, 2000, annotation=True),
              event("Optimizer.step#AdamW.step", 3000, 4000)]
    kernels = unique_kernels(e for e in events if not is_annotation(e))
    assert kernels == [("nvjet_sm90_tst_256x128", 0, 1000), ("triton_poi_fused_mul_silu_0", 1200, 1500)]
    groups = kernel_groups(kernels)
    assert groups["by_kind"] == [{"name": "gemm", "s": 0.001, "calls": 1}, {"name": "triton", "s": 0.0003, "calls": 1}]
    assert [r["calls"] for r in groups["by_name"]] == [1, 1]


def test_busy_time_is_the_union_of_overlapping_spans():
    assert union_us([(0, 10), (5, 12), (20, 25)]) == 17
    assert union_us([(3, 4), (0, 10)]) == 10
    assert union_us([]) == 0


def test_kernel_kinds():
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert kernel_kind("Memcpy DtoD (Device -> Device)") == "copy"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<8, CUDAFunctor_add>") == "elementwise"
    assert kernel_kind("something_else") == "other"
