"""Simulator behaviour: sharing rates, arm orderings that follow from the profile, golden runs."""

import json
from pathlib import Path

import pytest

from nodus.accounting import union_length
from nodus.simulate import config_from_args, simulate
from sim.gpu import pair_rates, sharing_rates
from sim.profile import BatchRates, load_profile

GOLDEN = Path(__file__).parent / "golden"
SCENARIOS = {
    "overlap8_mps": dict(jobs=8, policy="overlap", groups=2, sharing="mps", steps=4, seed=1),
    "sync8_none": dict(jobs=8, policy="shared-sync", sharing="none", steps=4, seed=1),
    "timeslice4_none": dict(jobs=4, policy="timeslice", groups=2, sharing="none", steps=3, seed=2),
    "overlap16_g4_mps": dict(jobs=16, policy="overlap", groups=4, sharing="mps", steps=3, seed=3),
}
KEYS = ("steps_per_gpu_hour", "ratio_vs_dedicated", "rollout_tokens_per_gpu_s", "gpu_seconds", "busy",
        "stale_rollouts", "steps")


def golden_summary(name: str) -> dict:
    s = simulate(config_from_args(**SCENARIOS[name]))
    flat = {k: s[k] for k in KEYS if k != "busy"}
    flat.update({f"busy_{k}": v for k, v in s["busy"].items()})
    return flat


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden(name):
    """Stored summaries; regenerate deliberately with `python tests/golden/regen.py`."""
    want = json.loads((GOLDEN / f"{name}.json").read_text())
    got = golden_summary(name)
    assert got["stale_rollouts"] == 0
    assert got == pytest.approx(want, rel=1e-9)


def test_sharing_rates_reproduce_the_measured_pair():
    cost = load_profile("h200-qwen3-0.6b").profile.sharing
    assert sharing_rates(["engine"], "none", cost) == [1.0]
    assert sharing_rates(["engine", "trainer"], "mps", cost) == [cost.mps_corun.engine, cost.mps_corun.trainer]
    assert sharing_rates(["trainer"], "mps", cost) == [cost.mps_alone.trainer]
    four = sharing_rates(["engine", "trainer", "engine", "trainer"], "none", cost)
    assert sum(four) == pytest.approx(cost.none_corun.engine + cost.none_corun.trainer)


def _with_batch_rates(cost, table):
    return cost.model_copy(update={"corun_by_engine_batch": [BatchRates(**e) for e in table]})


def test_corun_rates_follow_the_engine_batch_between_measured_points():
    cost = _with_batch_rates(load_profile("h200-qwen3-0.6b").profile.sharing, [
        {"batch": 64, "mps_corun": {"engine": 0.9, "trainer": 0.5}},
        {"batch": 256, "mps_corun": {"engine": 0.7, "trainer": 0.9}}])
    assert pair_rates("mps", cost, 64).trainer == pytest.approx(0.5)
    assert pair_rates("mps", cost, 160).trainer == pytest.approx(0.7)  # halfway
    assert pair_rates("mps", cost, 16).trainer == pytest.approx(0.5)  # the end points' beyond them
    assert pair_rates("mps", cost, 1024).engine == pytest.approx(0.7)
    assert pair_rates("mps", cost, None) == cost.mps_corun  # no batch known: the constants
    assert pair_rates("none", cost, 64) == cost.none_corun  # no table for this mode
    assert sharing_rates(["engine", "trainer"], "mps", cost, 160) == pytest.approx([0.8, 0.7])


def test_trainer_beside_a_small_decode_batch_is_slower_than_beside_a_large_one():
    """One train step of 1 s of work beside an engine decoding 64 vs 256 sequences: the rate
    table makes the first take 1/0.5 s, the second 1/0.9 s."""
    import simpy

    from sim.gpu import SharedGPU

    cost = _with_batch_rates(load_profile("h200-qwen3-0.6b").profile.sharing, [
        {"batch": 64, "mps_corun": {"engine": 0.9, "trainer": 0.5}},
        {"batch": 256, "mps_corun": {"engine": 0.7, "trainer": 0.9}}])
    took = {}
    for batch in (64, 256):
        env = simpy.Environment()
        gpu = SharedGPU(env, "mps", cost)
        env.process(gpu.work("engine", 100.0, batch=batch))

        def train(env=env, gpu=gpu, batch=batch):
            t0 = env.now
            yield from gpu.work("trainer", 1.0)
            took[batch] = env.now - t0
        env.process(train())
        env.run(until=50)
    assert took[64] == pytest.approx(2.0) and took[256] == pytest.approx(1 / 0.9)


def test_arm_ordering_follows_from_the_profile(tmp_path):
    """On sharing rates where MPS co-running is efficient (engine + trainer rates summing past 1,
    time-slicing well under it): sharing one engine and trainer beats dedicated; MPS without
    overlap only pays its alone penalty; overlap pays most with MPS."""
    prof = json.loads(load_profile("h200-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    prof["sharing"] = {"none_corun": {"engine": 0.48, "trainer": 0.65},
                       "mps_alone": {"engine": 0.84, "trainer": 0.84},
                       "mps_corun": {"engine": 0.6, "trainer": 0.82}}
    path = tmp_path / "efficient-mps.json"
    path.write_text(json.dumps(prof))
    r = {k: simulate(config_from_args(jobs=8, steps=4, profile=str(path), **v))["ratio_vs_dedicated"] for k, v in {
        "sync": dict(policy="shared-sync", sharing="none"),
        "sync_mps": dict(policy="shared-sync", sharing="mps"),
        "overlap_none": dict(policy="overlap", groups=2, sharing="none"),
        "overlap_mps": dict(policy="overlap", groups=2, sharing="mps")}.items()}
    assert r["sync"] > 1.0
    assert r["sync_mps"] < r["sync"]
    assert r["overlap_mps"] > r["overlap_none"]
    assert r["overlap_mps"] > r["sync"]


def test_profile_changes_move_the_prediction(tmp_path):
    """Nothing is hard-coded: a 5x faster trainer in the profile raises steps per GPU-hour."""
    prof = json.loads(load_profile("h200-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    prof["train"]["per_microbatch"]["a_s"] /= 5
    prof["train"]["per_microbatch"]["b_s_per_unit"] /= 5
    prof["train"]["s_per_adapter"] /= 5
    p = tmp_path / "fast.json"
    p.write_text(json.dumps(prof))
    slow = simulate(config_from_args(jobs=4, steps=3, profile="h200-qwen3-0.6b"))
    fast = simulate(config_from_args(jobs=4, steps=3, profile=str(p)))
    assert fast["steps_per_gpu_hour"] > 1.3 * slow["steps_per_gpu_hour"]


def test_engine_batches_jobs_together():
    """Shared-sync generation of 8 jobs takes far less than 8 dedicated generations."""
    s = simulate(config_from_args(jobs=8, steps=2, policy="shared-sync", sharing="none"))
    assert s["per_job"]["job0"]["slowdown_vs_alone"] < 8


def test_replayed_lengths_follow_the_trace(tmp_path):
    out = tmp_path / "run"
    simulate(config_from_args(jobs=2, steps=2, policy="shared-sync", sharing="none"), out)
    trace = out / "spans.jsonl"
    cfg = config_from_args({"jobs": [{"task": "gsm8k", "id": "job0", "steps": 2,
                                      "lengths": {"kind": "replay", "trace": str(trace)}}]},
                           policy="shared-sync", sharing="none")
    r = simulate(cfg, tmp_path / "replay")
    orig = [json.loads(x) for x in trace.read_text().splitlines()]
    rep = [json.loads(x) for x in (tmp_path / "replay" / "spans.jsonl").read_text().splitlines()]
    want = {d["attrs"]["step"]: d["attrs"]["response_tokens"] for d in orig if d["phase"] == "generate" and d["job"] == "job0"}
    got = {d["attrs"]["step"]: d["attrs"]["response_tokens"] for d in rep if d["phase"] == "generate"}
    assert got == want and r["stale_rollouts"] == 0


def test_union_length():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([]) == 0


def test_publish_is_slowed_only_while_a_train_step_runs_beside_it():
    """0.5 s of publish at factor 4 beside a 1 s train step from t=0: a quarter speed until t=1
    (0.25 s done), the rest alone, so it ends at 1.25. A step from t=0.2 to 1.2 rescales it midway:
    0.2 alone, 0.25 beside the step, 0.05 alone: 1.25 again. Alone or beside a generation: 0.5."""
    import simpy

    from sim.gpu import SharedGPU

    sharing = load_profile("h200-qwen3-0.6b").profile.sharing

    def publish_end(other: str | None, other_start_s: float, factor: float = 4.0) -> float:
        env = simpy.Environment()
        gpu = SharedGPU(env, "none", sharing)
        ends = []

        def other_work():
            yield env.timeout(other_start_s)
            yield from gpu.work(other, 1.0)  # alone without MPS: 1 s

        def publish():
            yield from gpu.host_work(0.5, factor)
            ends.append(env.now)
        if other:
            env.process(other_work())
        env.process(publish())
        env.run()
        return ends[0]

    assert publish_end("trainer", 0.0) == pytest.approx(1.25)
    assert publish_end("trainer", 0.2) == pytest.approx(1.25)
    assert publish_end("trainer", 0.6) == pytest.approx(0.5)  # done before the step starts
    assert publish_end("engine", 0.0) == pytest.approx(0.5)  # a generation does not slow it
    assert publish_end(None, 0.0) == pytest.approx(0.5)
    assert publish_end("trainer", 0.0, factor=1.0) == pytest.approx(0.5)


def _publish_factor_profile(tmp_path, factor: float | None) -> str:
    prof = json.loads(load_profile("h200-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    prof["publish"]["save_s_per_adapter"] = 0.04
    if factor is None:
        del prof["publish"]["corun_factor"]
    else:
        prof["publish"]["corun_factor"] = factor
    path = tmp_path / f"publish-x{factor}.json"
    path.write_text(json.dumps(prof))
    return str(path)


def _publishes(run: Path) -> dict[tuple, float]:
    """Per publish action (group, start): its seconds per adapter."""
    spans = [json.loads(x) for x in (run / "spans.jsonl").read_text().splitlines()]
    acts: dict[tuple, list] = {}
    for s in spans:
        if s["phase"] == "publish":
            acts.setdefault((s["group"], s["start_s"], s["end_s"]), []).append(s)
    return {k[:2]: (k[2] - k[1]) / len(v) for k, v in acts.items()}


def test_publish_corun_factor_slows_the_freed_trainers_publishes_not_the_waiting_ones(tmp_path):
    """A freed trainer takes the other group's step while a publish runs: at factor 5 those
    publishes take 5x the save time and the arm loses steps per GPU-hour; a waiting trainer never
    trains beside a publish (one stack), so its timeline does not move."""
    runs = {}
    for waits in (False, True):
        for factor in (1.0, 5.0):
            out = tmp_path / f"waits{waits}-x{factor}"
            cfg = config_from_args({"arm": {"trainer_waits_for_publish": waits}}, jobs=4, steps=4, policy="overlap",
                                   groups=2, sharing="mps", profile=_publish_factor_profile(tmp_path, factor))
            runs[waits, factor] = (simulate(cfg, out), out)
    slow, fast = _publishes(runs[False, 5.0][1]), _publishes(runs[False, 1.0][1])
    assert list(fast.values()) == pytest.approx([0.04] * len(fast))
    assert sorted(slow.values()) == pytest.approx([0.04] * 5 + [0.2] * 3)  # three beside a step
    assert runs[False, 5.0][0]["steps_per_gpu_hour"] < runs[False, 1.0][0]["steps_per_gpu_hour"]
    assert (runs[True, 5.0][1] / "spans.jsonl").read_text() == (runs[True, 1.0][1] / "spans.jsonl").read_text()


def test_default_publish_corun_factor_changes_nothing(tmp_path):
    """A profile without the field (every profile before it) reads as factor 1: the freed arm's
    timeline is byte-identical to one with 1.0 written out, and every publish takes its save time
    (the goldens above pin that the default moves no summary)."""
    assert load_profile("h200-qwen3-0.6b").profile.publish.corun_factor == 1.0
    texts = []
    for factor in (None, 1.0):
        out = tmp_path / f"x{factor}"
        simulate(config_from_args({"arm": {"trainer_waits_for_publish": False}}, jobs=4, steps=3, policy="overlap",
                                  groups=2, sharing="mps", profile=_publish_factor_profile(tmp_path, factor)), out)
        texts.append((out / "spans.jsonl").read_text())
        assert list(_publishes(out).values()) == pytest.approx([0.04] * 6)
    assert texts[0] == texts[1]


def test_continuous_policy_runs_every_job_on_policy_and_merges_trains(tmp_path):
    """policy continuous on the simulator: each job its own group, all generating from the start;
    every step done, nothing stale, and the trainer batched jobs whose rollouts were in together."""
    from nodus.accounting import audit_on_policy
    from nodus.timeline import read_jsonl

    out = tmp_path / "cont"
    s = simulate(config_from_args(jobs=8, steps=4, policy="continuous", sharing="mps"), out)
    assert s["steps"] == 32 and s["stale_rollouts"] == 0
    assert s["groups"] == 1  # its config names no group count (runs of it key and label alike)
    spans = [x for r in read_jsonl(out / "spans.jsonl") for x in r]
    assert audit_on_policy(spans) == []
    sizes = {(x.start_s, x.attrs["jobs_in_batch"]) for x in spans if x.phase == "train"}
    assert max(n for _, n in sizes) > 1 and sorted({x.group for x in spans}) == list(range(8))


def test_sweep_runs_shared_sync_and_continuous_once_per_sharing_mode():
    from nodus.simulate import sweep_arms

    arms = sweep_arms(8, ["dedicated", "shared-sync", "overlap", "continuous"], [2, 4], ["none", "mps"])
    assert [a for a in arms if a[0] == "continuous"] == [("continuous", 1, "none"), ("continuous", 1, "mps")]
    assert len([a for a in arms if a[0] == "overlap"]) == 4 and arms[0] == ("dedicated", 1, "none")


def test_the_sweep_names_the_best_arm_per_job_count_and_whether_the_error_bar_separates_it():
    from nodus.simulate import best_arms, sweep_table

    def row(jobs, policy, ratio, groups=1, sharing="mps", seed=1):
        return {"jobs": jobs, "policy": policy, "groups": groups, "sharing": sharing, "seed": seed,
                "ratio_vs_dedicated": ratio}

    rows = [row(8, "dedicated", 1.0, sharing="none"), row(8, "shared-sync", 2.0), row(8, "shared-sync", 2.2, seed=2),
            row(8, "overlap", 2.0, groups=2), row(4, "dedicated", 1.0, sharing="none"), row(4, "overlap", 1.5, groups=2)]
    best = best_arms(rows, error=0.08)
    assert [(b["jobs"], b["arm"]) for b in best] == [(4, "overlap g=2 mps"), (8, "shared-sync mps")]
    assert best[0]["next"] is None and not best[0]["within_error"]  # one shared arm at 4 jobs
    assert best[1]["ratio"] == pytest.approx(2.1) and best[1]["next"] == "overlap g=2 mps"
    assert best[1]["next_gap"] == pytest.approx(2.0 / 2.1 - 1) and best[1]["within_error"]  # 4.8% < 8%
    assert not best_arms(rows, error=0.04)[1]["within_error"]
    assert not best_arms(rows)[1]["within_error"]  # no error bar: nothing to say
    table = sweep_table(rows, {"heldout_mape": 0.08, "heldout_bias": 0.0, "heldout_worst": 0.1, "heldout_runs": 3})
    assert ("Best per job count: 4 jobs overlap g=2 mps (1.500x); 8 jobs shared-sync mps (2.100x, next overlap g=2 "
            "mps -4.8%, within the profile's error).") in table


def test_steps_past_the_engines_cuda_graphs_follow_its_graph_size(tmp_path):
    """A profile with graphless steps: 16 jobs' 1024 sequences queue past max_num_seqs 512, and a
    step admitting a waiting prompt beside ~511 decoding sequences is past vLLM's default 512-token
    graphs; an engine with graphs up to 1024 tokens (engine.cuda_graph_max_tokens) runs it graphed.
    A run that never queues (8 jobs) does not move. Without the term in the profile, nothing moves."""
    from nodus.config import EngineSpec, engine_graph_max_tokens

    assert engine_graph_max_tokens(EngineSpec()) == 512
    assert engine_graph_max_tokens(EngineSpec(max_num_seqs=128)) == 256
    assert engine_graph_max_tokens(EngineSpec(cuda_graph_max_tokens=1024)) == 1024
    prof = json.loads(load_profile("h200-xeon16-graphed-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    assert prof["decode"]["graph_max_tokens"] == 512 and prof["decode"]["graphless"]
    bare = dict(prof, decode={k: v for k, v in prof["decode"].items() if k not in ("graph_max_tokens", "graphless")})
    paths = {}
    for name, p in (("with", prof), ("bare", bare)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(p))

    def sph(name, jobs, graphs=None):
        cfg = config_from_args({"engine": {"cuda_graph_max_tokens": graphs}} if graphs else None, jobs=jobs,
                               steps=2, policy="shared-sync", sharing="mps", profile=str(paths[name]))
        s = simulate(cfg)
        steps = sum(d.get("graphless_steps", 0) for d in s["diagnostics"])
        assert (steps > 0) == (name == "with" and jobs == 16 and graphs == 512)  # the run says where they came from
        return s["steps_per_gpu_hour"]

    # vLLM's 512-token graphs, set: the queue's admitting steps run past them. Left unset, a new
    # config of 16 jobs sizes the graphs to 2 x max_num_seqs (size_engine_graphs); 8 jobs keep vLLM's.
    narrow16, sized16, wide16, bare16 = sph("with", 16, 512), sph("with", 16), sph("with", 16, 1024), sph("bare", 16)
    assert narrow16 < 0.8 * wide16 and wide16 == pytest.approx(bare16, rel=1e-9) == pytest.approx(sized16, rel=1e-9)
    assert sph("with", 8) == pytest.approx(sph("with", 8, 1024), rel=1e-9) == pytest.approx(sph("bare", 8), rel=1e-9)


def test_a_new_config_sizes_the_engines_graphs_past_its_batch_and_a_recorded_one_keeps_its_own():
    """size_engine_graphs: 2 x max_num_seqs where the jobs' sequences can exceed max_num_seqs (one
    job's under dedicated), vLLM's default elsewhere; a size given is kept, and a recorded config
    (build_config, as validate and fit read runs) is never resized."""
    from nodus.config import build_config, peak_engine_sequences

    def graphs(config=None, **kw):
        return config_from_args(config, steps=1, **kw).engine.cuda_graph_max_tokens

    assert graphs(jobs=16, policy="shared-sync") == 1024  # 16 x 64 = 1024 sequences > 512
    # Two groups' generations may overlap: on one slot per job, 1024 sequences; on the 8 slots a
    # new 16-job overlap config gets (nodus.runner.size_engine_slots), at most 8 jobs' 512.
    assert graphs({"engine": {"max_loras": 16}}, jobs=16, policy="overlap", groups=2) == 1024
    assert graphs(jobs=16, policy="overlap", groups=2) is None
    assert graphs(jobs=8, policy="shared-sync") is None  # 512: never queues
    assert graphs(jobs=16, policy="dedicated") is None  # one job's 64 at a time
    assert graphs({"engine": {"max_num_seqs": 256}}, jobs=8, policy="shared-sync") == 512
    assert graphs({"engine": {"max_num_seqs": 2048}}, jobs=16, policy="shared-sync") is None
    assert graphs({"engine": {"cuda_graph_max_tokens": 512}}, jobs=16, policy="shared-sync") == 512
    assert graphs(jobs=16, policy="timeslice", groups=2) is None  # each engine serves one job at a time
    cfg = config_from_args(jobs=16, steps=1, policy="shared-sync")
    assert peak_engine_sequences(cfg) == 1024
    # Engine args whose compilation_config sets the graph sizes keep them over the size nodus chose;
    # a size the config set stays (the engine then refuses the pair); other compilation settings merge.
    from nodus.config import engine_args_size_graphs

    own = (("compilation_config", {"cudagraph_capture_sizes": [8, 16]}),)
    assert engine_args_size_graphs(cfg, own).engine.cuda_graph_max_tokens is None
    assert engine_args_size_graphs(cfg, (("compilation_config", {"mode": 3}),)).engine.cuda_graph_max_tokens == 1024
    assert engine_args_size_graphs(cfg, (("max_logprobs", 5),)).engine.cuda_graph_max_tokens == 1024
    given = config_from_args({"engine": {"cuda_graph_max_tokens": 1024}}, jobs=16, steps=1, policy="shared-sync")
    assert engine_args_size_graphs(given, own).engine.cuda_graph_max_tokens == 1024
    # The report names the engine's graph size and the steps past it (none once sized).
    from nodus.simulate import render_table

    row = "| engine CUDA graphs up to (tokens a step) / steps past them | "
    profile = "h200-xeon16-graphed-qwen3-0.6b"
    assert row + "1024 / 0 |" in render_table(simulate(config_from_args(jobs=16, steps=1, profile=profile,
                                                                         policy="shared-sync")))
    narrow = render_table(simulate(config_from_args({"engine": {"cuda_graph_max_tokens": 512}}, jobs=16, steps=1,
                                                    policy="shared-sync", profile=profile)))
    assert row + "512 / " in narrow and row + "512 / 0 |" not in narrow
    recorded = json.loads(cfg.model_copy(update={"engine": cfg.engine.model_copy(
        update={"cuda_graph_max_tokens": None})}).model_dump_json())
    assert build_config(recorded).engine.cuda_graph_max_tokens is None


def test_step_rows_pack_each_prompts_responses_when_shared():
    from nodus.microbatch import step_rows

    assert step_rows(40, 4, [1, 2, 3, 4]) == [11, 12, 13, 14]
    # two prompts of two responses each (10 prompt tokens a sequence), up to 2 a row / 1 a row
    assert step_rows(40, 4, [1, 2, 3, 4], per_prompt=2, share=2) == [13, 17]
    assert step_rows(40, 4, [1, 2, 3, 4], per_prompt=2, share=1) == [11, 12, 13, 14]
    assert step_rows(60, 6, [1, 2, 3, 4, 5, 6], per_prompt=3, share=2) == [13, 13, 19, 16]


def test_shared_prompts_train_fewer_tokens_in_the_simulator_and_say_how_they_are_priced():
    """trainer.share_prompts: each prompt's responses packed into rows, its tokens once, so train
    steps are shorter; the report names the setting as priced with a term measured on the trainer alone."""
    from nodus.config import DEFAULT_PROFILE, DEFAULT_PROFILES, ConfigError

    got = {}
    for share in (0, 4):
        cfg = config_from_args({"trainer": {"share_prompts": share}}, policy="shared-sync", groups=1, sharing="mps",
                               steps=3, seed=1, profile=DEFAULT_PROFILES["graphed"])
        got[share] = simulate(cfg)
    assert got[4]["steps_per_gpu_hour"] > got[0]["steps_per_gpu_hour"]
    assert not any("share_prompts" in f for f in got[0]["outside_profile"])
    assert any("trainer.share_prompts=4" in f and "came out short" in f
               for f in got[4]["outside_profile"])
    # The eager trainer cannot run it (the real backend refuses): nor is it simulated on its profile.
    eager = config_from_args({"trainer": {"share_prompts": 4}}, policy="shared-sync", groups=1, sharing="mps",
                             steps=3, seed=1, profile=DEFAULT_PROFILE)
    with pytest.raises(ConfigError, match="share_prompts=4 runs on the graphed trainer only"):
        simulate(eager)


def test_two_stacks_run_each_stacks_jobs_on_its_own_engine_and_trainer(tmp_path):
    """arm.stacks = 2 on the simulator: every step done on-policy, each job on one stack, both
    stacks generating from the start; the summary and the run's table name the stacks."""
    from nodus.accounting import audit_on_policy
    from nodus.timeline import read_jsonl

    out = tmp_path / "k2"
    s = simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", stacks=2), out)
    assert s["steps"] == 12 and s["stale_rollouts"] == 0 and s["arm"]["stacks"] == 2
    spans = [x for r in read_jsonl(out / "spans.jsonl") for x in r]
    assert audit_on_policy(spans) == []
    stacks = {}
    for x in spans:
        assert stacks.setdefault(x.job, x.stack) == x.stack
    assert sorted(set(stacks.values())) == [0, 1]
    assert {x.stack for x in spans if x.phase == "generate" and x.start_s == 0} == {0, 1}
    assert "2 stacks" in (out / "table.md").read_text()


def test_a_run_whose_trainer_graph_capture_failed_says_it_trained_eager():
    """Session 29's two-stack arms: a trainer's capture ran out of memory and it trained eager. The
    run's table says so and names the trainer; a run whose captures held says nothing."""
    from nodus.simulate import render_table, trainer_graph_failures

    s = simulate(config_from_args(jobs=2, steps=1))
    assert trainer_graph_failures(s) == [] and "Trained eager" not in render_table(s)
    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB.\nmore detail"
    s["diagnostics"] = [{"workers": {"engine0": {"torch_threads": 16},
                                     "trainer0": {"step_mode": "graphed", "graph_error": None},
                                     "trainer1": {"step_mode": "eager", "graph_error": oom}}}]
    assert trainer_graph_failures(s) == ["trainer1: OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB."]
    text = render_table(s)
    assert "Trained eager: the CUDA-graph capture failed (trainer1: OutOfMemoryError" in text
    assert "more detail" not in text
    # A dedicated run records its one trainer once a job (a failed capture stays eager for good): the
    # trainer named once, with its first error.
    s["diagnostics"] = [{"workers": {"trainer0": {"step_mode": "graphed", "graph_error": None}}},
                        {"workers": {"trainer0": {"step_mode": "eager", "graph_error": oom}}},
                        {"workers": {"trainer0": {"step_mode": "eager", "graph_error": "RuntimeError: other"}}}]
    assert trainer_graph_failures(s) == ["trainer0: OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB."]
