"""Two stacks' three MPS rates fitted together on phase times (`nodus fit-stacks --rate phases`):
the engines' rate beside a lone trainer of stacks in the simulator, and the fit recovering known
rates from runs the simulator recorded with them."""

import json

import pytest

from calibration.stacks_phases import FIELDS, fit
from calibration.validate import stacks_fit_run
from nodus.cli import main
from nodus.config import DEFAULT_PROFILE, ConfigError
from nodus.simulate import config_from_args, simulate
from sim.gpu import sharing_rates
from sim.profile import load_profile, profile_dict, write_profile


def _profile(tmp_path, name, **rates):
    """The default profile with the given sharing rates (mps_engines, mps_stacks_trainer, ...)."""
    prof = profile_dict(DEFAULT_PROFILE)
    prof["sharing"].update(rates)
    path = tmp_path / name
    write_profile(prof, path, "test")
    return str(path)


def test_engines_beside_a_lone_trainer_of_stacks_take_their_fitted_rate(tmp_path):
    cost = load_profile(_profile(tmp_path, "p.json", mps_engines=0.8, mps_stacks_trainer=0.95,
                                 mps_stacks_engine=0.6)).profile.sharing
    alone = cost.mps_alone.engine
    assert sharing_rates(["engine", "trainer"], "mps", cost) == pytest.approx([0.6, 0.95])
    e, e2, t = sharing_rates(["engine", "engine", "trainer"], "mps", cost)
    assert t == pytest.approx(0.95) and e == e2 == pytest.approx(0.8 * 0.6 / alone)
    # Without a lone trainer nothing changes: two engines alone, two trainers beside an engine.
    plain = load_profile(_profile(tmp_path, "q.json", mps_engines=0.8, mps_stacks_trainer=0.95)).profile.sharing
    for kinds in (["engine", "engine"], ["engine", "trainer", "trainer"], ["trainer"], ["engine"]):
        assert sharing_rates(kinds, "mps", cost) == sharing_rates(kinds, "mps", plain)
    assert sharing_rates(["engine", "trainer"], "none", cost) == sharing_rates(["engine", "trainer"], "none", plain)
    # It is the lone trainer's companion: without that rate the pair's engine rate stays.
    pair = load_profile(_profile(tmp_path, "r.json", mps_engines=0.8, mps_stacks_engine=0.6)).profile.sharing
    assert sharing_rates(["engine", "trainer"], "mps", pair) == pytest.approx(
        [pair.mps_corun.engine, pair.mps_corun.trainer])
    # One stack keeps the pair's rates its own runs were fitted on; two stacks move with it.
    kw = dict(jobs=4, steps=3, policy="overlap", groups=2, sharing="mps", seed=1)
    slow = _profile(tmp_path, "slow.json", mps_engines=0.8, mps_stacks_trainer=0.95, mps_stacks_engine=0.2)
    fast = _profile(tmp_path, "fast.json", mps_engines=0.8, mps_stacks_trainer=0.95, mps_stacks_engine=1.5)
    assert simulate(config_from_args(profile=slow, **kw))["steps_per_gpu_hour"] == pytest.approx(
        simulate(config_from_args(profile=fast, **kw))["steps_per_gpu_hour"])
    kw["stacks"] = 2
    assert simulate(config_from_args(profile=slow, **kw))["steps_per_gpu_hour"] < \
        simulate(config_from_args(profile=fast, **kw))["steps_per_gpu_hour"]


def _runs(tmp_path, truth):
    """Two-stack runs of 4 jobs, recorded by the simulator on ``truth``: two free-running, whose stacks
    drift into each case (both generating, both training, one training beside the other's
    generation), and one offset (a lone trainer beside the other stack's generation every cycle)."""
    runs = []
    for seed, offset in ((1, False), (2, False), (3, True)):
        out = tmp_path / f"k2-s{seed}{'-off' if offset else ''}"
        simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", stacks=2, seed=seed,
                                  offset_stacks=offset, share_prompts=0, profile=truth), out)
        runs.append(out)
    return runs


def test_fit_stacks_phases_recovers_the_three_rates_the_runs_were_simulated_with(tmp_path, capsys):
    truth_rates = {"mps_engines": 0.7, "mps_stacks_trainer": 0.9, "mps_stacks_engine": 0.5}
    runs = _runs(tmp_path, _profile(tmp_path, "truth.json", **truth_rates))
    out = tmp_path / "fitted.json"
    # (the runs' two trainers together went by the many-clients rule: the base's, kept)
    assert main(["fit-stacks", *map(str, runs), "--rate", "phases", "--no-fit-trainers", "--base", DEFAULT_PROFILE,
                 "--out", str(out), "--report", str(tmp_path / "rep")]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "sets of rates replayed on 3 run(s)" in captured.err  # the search's progress
    assert "sharing.mps_trainers not fitted (--no-fit-trainers); the base's: none" in printed
    prof = json.loads(out.read_text())
    for f, want in truth_rates.items():
        assert prof["sharing"][f] == pytest.approx(want, rel=0.03), f
        assert float(printed.split(f"sharing.{f} = ")[1].split()[0]) == pytest.approx(want, rel=0.03)
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert rep["loss"] < 1e-4 and all(abs(r["error"]) < 0.01 for r in rep["rows"])
    assert rep["base_rates"] == {f: None for f in FIELDS}  # the default profile has none of them
    assert "sharing.mps_stacks_engine" in (tmp_path / "rep.md").read_text()
    # How each run's stacks lined up: the offset run's generations ran beside the other's least.
    shares = [r["beside_engines"] for r in rep["rows"]]
    assert all(0 <= x <= 1 for x in shares) and shares[2] < min(shares[:2])
    assert "ran beside the other stack's generation for" in (tmp_path / "rep.md").read_text()
    assert "of its generation beside the other stack's" in printed
    ids = {a["id"] for a in prof["assumptions"]}
    assert {"sharing-two-engines", "sharing-stacks-trainer"} <= ids
    # The runs mixed free and offset stacks: the rates hold for either (no alignment recorded), and a
    # lockstep run is not flagged as another alignment than the fit's.
    assert "offset_stacks" not in prof["sharing"]["engines_controls"]
    lock = simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", stacks=2, seed=1,
                                     lockstep=True, share_prompts=0, profile=str(out)))
    assert not any("arm.lockstep" in f for f in lock["outside_profile"])
    # The fit runs' engines generated 128 sequences at once (2 jobs of 64 a stack): recorded, and an
    # arm whose engines generate more is flagged as priced past the fit (8 jobs: 256), that one not.
    assert prof["sharing"]["stacks_engine_sequences"] == 128
    assert not any("stacks_engine_sequences" in f for f in lock["outside_profile"])
    # The base's error bar measured the base: the fitted profile carries none until validated.
    assert load_profile(DEFAULT_PROFILE).validation() and "validation" not in prof
    eight = simulate(config_from_args(jobs=8, steps=1, policy="shared-sync", sharing="mps", stacks=2, seed=1,
                                      share_prompts=0, profile=str(out)))
    assert any("stacks_engine_sequences" in f and "up to 256 > profiled 128" in f for f in eight["outside_profile"])
    # Its runs count as fitted in nodus validate (both rates' fit records are this fit's).
    assert all(stacks_fit_run(prof, r) for r in runs)
    assert prof["measurements"]["stacks"]["fitted_on"] == "phases"
    assert main(["fit-stacks", *map(str, runs), "--rate", "phases", "--base", DEFAULT_PROFILE, "--out", str(out)]) == 2
    assert "never overwrites" in capsys.readouterr().err


def test_fit_stacks_phases_keeps_each_rate_within_its_kind_alone_under_mps(tmp_path):
    """A client beside others runs no faster than alone in its MPS share: runs recorded with an
    engine beside a lone trainer faster than that (another term mispriced, as on session 55's H100
    runs) fit that rate at its bound, which the report names, and the other two rates as before."""
    from calibration.stacks_phases import report_markdown, upper

    base = profile_dict(DEFAULT_PROFILE)
    top = upper(base)
    assert top == {"mps_engines": base["sharing"]["mps_alone"]["engine"],
                   "mps_stacks_trainer": base["sharing"]["mps_alone"]["trainer"],
                   "mps_stacks_engine": base["sharing"]["mps_alone"]["engine"],
                   "mps_trainers": base["sharing"]["mps_alone"]["trainer"]}
    truth = {"mps_engines": 0.7, "mps_stacks_trainer": 0.9, "mps_stacks_engine": 1.5 * top["mps_stacks_engine"]}
    r = fit(_runs(tmp_path, _profile(tmp_path, "truth.json", **truth)), DEFAULT_PROFILE, trainers=False)
    # (at its bound within the search's resolution, 0.2%)
    assert r["mps_stacks_engine"] == pytest.approx(top["mps_stacks_engine"], rel=0.002)
    assert r["at_bound"] == ["mps_stacks_engine"]
    assert all(r[f] <= top[f] for f in FIELDS if r[f] is not None) and r["upper"] == top
    assert "(at its bound)" in report_markdown(r) and "At its bound: `sharing.mps_stacks_engine`" in report_markdown(r)


def test_fit_stacks_phases_refuses_runs_without_what_a_rate_prices(monkeypatch, tmp_path):
    import calibration.stacks_phases as sp

    runs = _runs(tmp_path, _profile(tmp_path, "truth.json", mps_engines=0.7))
    real_predict = sp.predict
    # A simulator in which the engine beside a lone trainer never ran: that rate moves nothing.
    monkeypatch.setattr(sp, "predict", lambda rows, prof, rates, tmp: real_predict(
        rows, prof, dict(rates, mps_stacks_engine=0.5), tmp))
    with pytest.raises(ConfigError, match=r"same whatever sharing.mps_stacks_engine is.*offset-stacks"):
        fit(runs, DEFAULT_PROFILE)
    # A run of one stack is refused as fit-stacks refuses it.
    one = tmp_path / "one"
    simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps"), one)
    with pytest.raises(ConfigError, match="arm.stacks=2"):
        fit([one], DEFAULT_PROFILE)


def test_fit_stacks_phases_tie_engines_fits_one_rate_for_an_engine_beside_either(tmp_path, capsys):
    """--tie-engines: runs recorded with an engine at one rate beside another stack's engine or its
    lone trainer give that rate back for both, and the lone trainer's; the report and the profile say
    the two are tied. Where the three-rate fit puts the engine beside the trainer at its bound, its
    report points to the tie; with another --rate the flag is refused."""
    from calibration.stacks_phases import report_markdown

    truth = {"mps_engines": 0.6, "mps_stacks_trainer": 0.9, "mps_stacks_engine": 0.6}
    runs = _runs(tmp_path, _profile(tmp_path, "truth.json", **truth))
    out = tmp_path / "tied.json"
    assert main(["fit-stacks", *map(str, runs), "--rate", "phases", "--tie-engines", "--base", DEFAULT_PROFILE,
                 "--out", str(out), "--report", str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out
    assert "sharing.mps_stacks_engine = " in printed and "tied to the two-engine rate" in printed
    prof = json.loads(out.read_text())
    assert prof["sharing"]["mps_engines"] == pytest.approx(0.6, rel=0.03)
    assert prof["sharing"]["mps_stacks_trainer"] == pytest.approx(0.9, rel=0.03)
    assert prof["sharing"]["mps_stacks_engine"] == prof["sharing"]["mps_engines"]
    assert prof["measurements"]["stacks"]["tie_engines"] is True
    assert "--tie-engines" in next(a["what"] for a in prof["assumptions"] if a["id"] == "sharing-stacks-trainer")
    assert "(tied to the two-engine rate)" in (tmp_path / "rep.md").read_text()
    from nodus.simulate import error_bar_line  # what every sim report on the profile says of its rates

    assert "--rate phases --tie-engines" in error_bar_line(load_profile(str(out)).validation())
    # The three-rate fit's report at the engine's bound points to the tie.
    r = {"base": "b", "settings": {}, "base_rates": {f: None for f in FIELDS}, "tie_engines": False,
         "mps_engines": 0.45, "mps_stacks_trainer": 0.7, "mps_stacks_engine": 1.05, "at_bound": ["mps_stacks_engine"],
         "upper": {f: 1.05 for f in FIELDS}, "replays": 1, "rows": [], "phase_mape": {"generate": 0, "train": 0},
         "base_phase_mape": {"generate": 0, "train": 0}, "mape": 0, "base_mape": 0}
    assert "fit again with --tie-engines" in report_markdown(r)
    assert "--tie-engines" not in report_markdown(dict(r, at_bound=["mps_stacks_trainer"]))
    assert main(["fit-stacks", *map(str, runs), "--rate", "engines", "--tie-engines", "--base", DEFAULT_PROFILE,
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "use it with --rate phases" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_trainers_of_stacks_training_together_take_their_fitted_rate(tmp_path):
    """sharing.mps_trainers: each of two trainers (or more) training at once under MPS goes at it,
    slowed beside an engine as one trainer is (the pair's trainer rate over its alone rate); without
    it, the many-clients rule; a backend of one stack drops it."""
    cost = load_profile(_profile(tmp_path, "p.json", mps_engines=0.8, mps_trainers=0.45)).profile.sharing
    plain = load_profile(_profile(tmp_path, "q.json", mps_engines=0.8)).profile.sharing
    assert sharing_rates(["trainer", "trainer"], "mps", cost) == pytest.approx([0.45, 0.45])
    pair = plain.mps_corun
    assert sharing_rates(["trainer", "trainer"], "mps", plain) == pytest.approx(
        [(pair.engine + pair.trainer) / 2] * 2)
    e, t1, t2 = sharing_rates(["engine", "trainer", "trainer"], "mps", cost)
    assert t1 == t2 == pytest.approx(0.45 * pair.trainer / cost.mps_alone.trainer)
    assert e == sharing_rates(["engine", "trainer", "trainer"], "mps", plain)[0]
    # One trainer, or no MPS: nothing changes.
    for kinds in (["engine", "trainer"], ["engine", "engine", "trainer"], ["trainer"]):
        assert sharing_rates(kinds, "mps", cost) == sharing_rates(kinds, "mps", plain)
    assert sharing_rates(["trainer", "trainer"], "none", cost) == sharing_rates(["trainer", "trainer"], "none", plain)
    slow = _profile(tmp_path, "slow.json", mps_engines=0.8, mps_trainers=0.2)
    fast = _profile(tmp_path, "fast.json", mps_engines=0.8, mps_trainers=1.0)
    kw = dict(jobs=4, steps=3, policy="overlap", groups=2, sharing="mps", seed=1)
    assert simulate(config_from_args(profile=slow, **kw))["steps_per_gpu_hour"] == pytest.approx(
        simulate(config_from_args(profile=fast, **kw))["steps_per_gpu_hour"])
    kw = dict(jobs=4, steps=3, policy="shared-sync", sharing="mps", stacks=2, lockstep=True, share_prompts=0, seed=1)
    assert simulate(config_from_args(profile=slow, **kw))["steps_per_gpu_hour"] < \
        simulate(config_from_args(profile=fast, **kw))["steps_per_gpu_hour"]


def test_fit_stacks_phases_fits_the_two_trainer_rate_where_the_runs_trained_together(tmp_path, capsys):
    """Runs recorded with two trainers together at a rate of their own, lockstep ones among them: the
    fit gives it back with the others (tied engines); --no-fit-trainers keeps the base's (the
    many-clients rule), which leaves the lockstep runs' trains short; on runs whose trains never ran
    together it is left out by default and refused when asked for."""
    truth_rates = {"mps_engines": 0.6, "mps_stacks_trainer": 0.9, "mps_stacks_engine": 0.6, "mps_trainers": 0.35}
    truth = _profile(tmp_path, "truth.json", **truth_rates)
    runs = _runs(tmp_path, truth)
    for seed in (1, 2):
        out = tmp_path / f"k2-lock-s{seed}"
        simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", stacks=2, seed=seed,
                                  lockstep=True, share_prompts=0, profile=truth), out)
        runs.append(out)
    out = tmp_path / "fitted.json"
    assert main(["fit-stacks", *map(str, runs), "--rate", "phases", "--tie-engines", "--base", DEFAULT_PROFILE,
                 "--out", str(out), "--report", str(tmp_path / "rep")]) == 0
    printed = capsys.readouterr().out
    prof = json.loads(out.read_text())
    for f, want in truth_rates.items():
        assert prof["sharing"][f] == pytest.approx(want, rel=0.03), f
    assert float(printed.split("sharing.mps_trainers = ")[1].split()[0]) == pytest.approx(0.35, rel=0.03)
    assert "sharing-stacks-trainers" in {a["id"] for a in prof["assumptions"]}
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert rep["trainers_fitted"] is True and all(abs(r["phase_error"]["train"]) < 0.01 for r in rep["rows"])
    # The lockstep runs' trains ran beside the other stack's throughout; the offset run's hardly.
    assert all(r["beside_trainers"] > 0.95 for r in rep["rows"][3:])
    assert rep["rows"][2]["beside_trainers"] < 0.5
    assert "train steps ran beside the other stack's train step for" in (tmp_path / "rep.md").read_text()
    # The many-clients rule in its place (the other fitted rates kept) leaves the lockstep runs' trains short.
    import calibration.stacks_phases as sp

    base = profile_dict(DEFAULT_PROFILE)
    rows = sp.phase_rows(runs[3:], base)
    rule = sp.predict(rows, base, {f: prof["sharing"][f] for f in FIELDS[:3]}, tmp_path)
    assert all(e["train"] < -0.1 for e in sp.phase_errors(rule, rows))
    # Runs whose stacks never train together (held exactly out of step): the rate moves nothing, and
    # asked for, it is refused, naming the runs that would show it.
    held = []
    for seed in (1, 2):
        o = tmp_path / f"k2-hold-s{seed}"
        simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", stacks=2, seed=seed,
                                  hold_apart=0.5, share_prompts=0, profile=truth), o)
        held.append(o)
    rows = sp.phase_rows(held, base)
    assert [r["beside_trainers"] for r in rows] == [0.0, 0.0]
    assert sp.trainers_identified(rows, base, sp._start(base), tmp_path) < sp.IDENTIFIED_MIN
    with pytest.raises(ConfigError, match=r"same whatever sharing.mps_trainers is.*lockstep"):
        sp.check_identified(rows, base, sp._start(base), tmp_path, ("mps_trainers",))
    # By default the fit leaves out a rate that moves the runs' phase times less than that.
    real = sp.trainers_identified
    try:
        sp.trainers_identified = lambda *a: 0.001
        left = fit(runs[:3], DEFAULT_PROFILE, tie_engines=True)
    finally:
        sp.trainers_identified = real
    assert left["trainers_fitted"] is False and left["mps_trainers"] is None and left["trainers_moved"] == 0.001
    assert "left as the base has it" in sp.report_markdown(left)
    assert main(["fit-stacks", *map(str, runs), "--rate", "engines", "--fit-trainers", "--base", DEFAULT_PROFILE,
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "use it with --rate phases" in capsys.readouterr().err
