"""Evidence that GRPO through nodus learns: the project's own tiny base model (trained once on
task text, cached), one job on a finite 8-prompt training set, the real backend on the CPU."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

STEPS = 12
MARGIN = 0.10  # mean reward of the last 3 steps over the first 3


@pytest.fixture(scope="module")
def pool():
    """The tiny base's engine and trainer, started once for this file's runs (an engine start is
    a large part of a short run): the pool keeps them across runs and restarts only the trainer for
    other trainer settings (nodus.realrun.ClusterPool), as gpu_arms runs its arms (dedicated, then
    the shared ones) on one cluster."""
    from nodus.realrun import ClusterPool

    p = ClusterPool(None, min_loras=4)
    yield p
    p.close()


# Four jobs of four tasks, 3 steps each: the equal-learning tests' workload.
JOBS4 = [{"task": t, "steps": 3, "prompts_per_step": 4, "responses_per_prompt": 4, "max_new_tokens": 24,
          "learning_rate": 1e-3, "lora_rank": 16, "seed": 10 + i, "prompt_pool": 8}
         for i, t in enumerate(["sorting", "counting", "modular", "reverse"])]
DEDICATED = {"policy": "dedicated", "groups": 1, "sharing": "none"}


@pytest.fixture(scope="module")
def dedicated4(tmp_path_factory, pool):
    """JOBS4 each alone (dedicated), run once for the tests that compare a shared arm with it: the
    run's folder and each job's (per-step rewards, final eval correct)."""
    from nodus.config import build_config

    out = tmp_path_factory.mktemp("learning") / "dedicated"
    s = _run(pool, build_config({"jobs": JOBS4, "arm": DEDICATED, "seed": 1}), out)
    assert s["stale_rollouts"] == 0
    return out, {j: (d["rewards"], d["eval"]["correct"]) for j, d in s["per_job"].items()}


def _run(pool, cfg, out, **opts):
    """A run (no baseline) on the module's pool, as gpu_arms runs its arms (``run_arm``, then the run
    folder ``write_run`` writes), with RealOptions(model=<the tiny base>, **opts): the summary. A failed
    run stops the pool's processes (``factories.run_on_pool``)."""
    from factories import run_on_pool
    from nodus.outdir import make_out_dir
    from nodus.simulate import write_run
    from real.backend import RealOptions, with_audit
    from real.base_model import ensure_tiny_base

    cfg, real_opts = with_audit(cfg, RealOptions(model=str(ensure_tiny_base(log=lambda s: None)), **opts))
    summary, runs = run_on_pool(pool, cfg, real_opts)
    write_run(make_out_dir(out), cfg, summary, runs)  # the config with the audit the run ran
    return summary


def test_grpo_raises_the_mean_reward_on_sorting(tmp_path, pool):
    from nodus.config import build_config

    cfg = build_config({
        "jobs": [{"task": "sorting", "steps": STEPS, "prompts_per_step": 8, "responses_per_prompt": 8,
                  "max_new_tokens": 32, "learning_rate": 1e-3, "lora_rank": 16, "seed": 3, "prompt_pool": 8}],
        "arm": {"policy": "shared-sync", "groups": 1, "sharing": "none"}})
    s = _run(pool, cfg, tmp_path / "run", audit_logprobs=False)
    rewards = s["per_job"]["job0"]["rewards"]
    assert len(rewards) == STEPS and s["stale_rollouts"] == 0
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"sorting: mean reward {first:.3f} (steps 0-2) -> {last:.3f} (steps {STEPS - 3}-{STEPS - 1}); "
          f"eval {s['per_job']['job0']['eval']['accuracy']:.3f}")
    assert last >= first + MARGIN, rewards


def test_overlap_learns_exactly_what_dedicated_learns_in_fp32(tmp_path, pool, dedicated4):
    """Equal learning by construction: 4 jobs, each alone on its 'own GPU' (dedicated) and two
    groups sharing one engine and one trainer (overlap). In fp32 on the CPU, with seeded
    sampling, every job's per-step rewards and final eval are identical, so the shared batches
    change nothing but speed; on a GPU only bf16 rounding of different batch shapes can move them
    (what `nodus compare` then judges)."""
    from nodus.compare import compare_runs
    from nodus.config import build_config

    ded_dir, dedicated = dedicated4
    s = _run(pool, build_config({"jobs": JOBS4, "arm": {"policy": "overlap", "groups": 2, "sharing": "none"},
                                 "seed": 1}), tmp_path / "overlap")
    assert s["stale_rollouts"] == 0
    assert {j: (d["rewards"], d["eval"]["correct"]) for j, d in s["per_job"].items()} == dedicated
    assert any(sum(r) > 0 for r, _ in dedicated.values())  # something was learned from
    vs = compare_runs([str(ded_dir), str(tmp_path / "overlap")], n_boot=200)["arms"][1]["vs_baseline"]
    assert vs["acc_diff"]["lo"] == vs["acc_diff"]["hi"] == 0.0


def test_shared_prompts_learn_what_plain_rows_learn(tmp_path, pool):
    """trainer.share_prompts changes how a step's rows are laid out, not what is learned: the same
    2 jobs (2 groups, the fixed-shape trainer) with each prompt's responses packed 4 to a row and
    with plain rows, in fp32 on the CPU with seeded sampling. The packed updates land ~1e-6 from
    the plain ones, so a sampled token may flip only where its draw falls that close to a
    boundary: every job's per-step rewards and its final eval agree (on this machine exactly, as
    with 4 jobs), and the runs learn from something. Through the real backend: the fixed-shape
    trainer's programs are the packed ones, the run stays on-policy with the engine's logprobs
    agreeing with the training forward's, the first step's gradients are plain rows' (fp32), and
    without the graphed trainer the setting is refused before any folder or process."""
    import json

    from nodus.compare import compare_runs
    from nodus.config import build_config
    from nodus.realrun import run
    from real.backend import BackendConfigError, RealOptions
    from real.base_model import ensure_tiny_base

    model = ensure_tiny_base(log=lambda s: None)
    jobs = [{"task": t, "steps": 3, "prompts_per_step": 4, "responses_per_prompt": 4, "max_new_tokens": 24,
             "learning_rate": 1e-3, "lora_rank": 16, "seed": 10 + i, "prompt_pool": 8}
            for i, t in enumerate(["sorting", "counting"])]
    arm = {"policy": "overlap", "groups": 2, "sharing": "none"}
    cfgs = {share: build_config({"jobs": jobs, "arm": arm, "seed": 1, "trainer": {"share_prompts": share}})
            for share in (0, 4)}
    out, worker, grads = {}, {}, {}
    # One trainer process for both runs (the pool's): packed first, so that its programs when it
    # ran packed are the packed ones only (the plain run adds plain ones beside them).
    for share in (4, 0):
        s = _run(pool, cfgs[share], tmp_path / f"sp{share}", trainer_graphs=True)
        assert s["stale_rollouts"] == 0
        assert max(a["max_abs"] for a in s["diagnostics"][0]["logprob_agreement"]) < 1e-3
        out[share] = {j: (d["rewards"], d["eval"]["correct"]) for j, d in s["per_job"].items()}
        # The run's own snapshot of its trainer's state (the pool's trainer goes on to the next run).
        worker[share] = s["diagnostics"][0]["workers"]["trainer0"]
        spans = [json.loads(line) for line in (tmp_path / f"sp{share}" / "spans.jsonl").read_text().splitlines()]
        grads[share] = {sp["job"]: sp["attrs"]["grad_norm"] for sp in spans
                        if sp["phase"] == "train" and sp["attrs"]["step"] == 0}
    assert worker[4]["graphs"] and all("shared=True" in g for g in worker[4]["graphs"])
    assert (worker[0]["share_prompts"], worker[4]["share_prompts"]) == (0, 4)
    # a group's job: 4 prompts x 4 responses, then 1 row a prompt
    assert (worker[0]["last_step_rows"], worker[4]["last_step_rows"]) == (4 * 4, 4)
    assert set(grads[0]) == {"job0", "job1"}
    for job, norm in grads[0].items():
        assert grads[4][job] == pytest.approx(norm, rel=1e-4)
    assert any(sum(r) > 0 for r, _ in out[0].values())
    for job, (rewards, correct) in out[0].items():
        assert out[4][job][0] == pytest.approx(rewards, abs=0.05), job
    report = compare_runs([str(tmp_path / "sp0"), str(tmp_path / "sp4")], baseline="overlap/none/g2", n_boot=200)
    assert [a["arm"] for a in report["arms"]] == ["overlap/none/g2", "overlap/none/g2+sp4"]
    vs = report["arms"][1]["vs_baseline"]
    assert abs(vs["acc_diff"]["mean"]) <= 0.05 and abs(vs["reward_diff"]["mean"]) <= 0.05, vs
    with pytest.raises(BackendConfigError, match="share_prompts=4.*--trainer-graphs"):
        run(cfgs[4], opts=RealOptions(model=str(model)), baseline=False, out=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_two_stacks_learn_exactly_what_dedicated_learns_in_fp32(tmp_path, pool, dedicated4):
    """Equal learning with two stacks (arm.stacks = 2: two engines and two trainers, each serving
    two of the 4 jobs; session 30-31's fastest arm on the H200): in fp32 on the CPU, with seeded
    sampling, every job's per-step rewards and final eval are those of the job alone (dedicated).
    Last in this file: the pool starts a two-stack cluster for it (one cluster at a time)."""
    from nodus.compare import compare_runs
    from nodus.config import build_config

    ded_dir, dedicated = dedicated4
    s = _run(pool, build_config({"jobs": JOBS4, "arm": {"policy": "shared-sync", "groups": 1, "sharing": "none",
                                                         "stacks": 2}, "seed": 1}), tmp_path / "stacks")
    assert s["stale_rollouts"] == 0
    assert s["arm"]["stacks"] == 2 and len(s["diagnostics"][0]["workers"]) == 4  # two engines, two trainers
    # Each stack's engine sampled from each new adapter: its logprobs agree with its trainer's
    # forward of that version, versions after the first included (a stale engine would not agree).
    agree = s["diagnostics"][0]["logprob_agreement"]
    assert {a["version"] for a in agree} == {0, 1, 2} and max(a["max_abs"] for a in agree) < 1e-3
    assert {j: (d["rewards"], d["eval"]["correct"]) for j, d in s["per_job"].items()} == dedicated
    assert any(sum(r) > 0 for r, _ in dedicated.values())  # something was learned from
    vs = compare_runs([str(ded_dir), str(tmp_path / "stacks")], n_boot=200)["arms"][1]["vs_baseline"]
    assert vs["acc_diff"]["lo"] == vs["acc_diff"]["hi"] == 0.0
