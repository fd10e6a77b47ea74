"""experiments/crossday.py: each profile against each day's held-out runs, the across-days error,
and its annotation in a profile (nodus profiles and every sim report then carry it)."""

import json
import shutil

import pytest

from nodus.simulate import config_from_args, simulate

OLD = "h200-xeon16-graphed-qwen3-0.6b"  # MPS rates fitted at the default trainer priority
NEW = "h200-xeon16-graphed-session16-qwen3-0.6b"  # ... with the trainer below normal


def _run(out, priority="normal", profile=OLD, graphed=True, **kw):
    """A run the simulator recorded, dressed as a real one: its trainer, kernels and MPS settings."""
    simulate(config_from_args(jobs=8, steps=2, seed=1, profile=profile, **kw), out)
    summary = json.loads((out / "summary.json").read_text())
    summary["diagnostics"] = [{
        "sharing_controls": {"trainer_priority": priority, "engine_thread_pct": None, "trainer_thread_pct": None},
        "workers": {"engine0": {"lora_kernel_configs": {"source": "shipped", "folder": "real/lora_configs"}},
                    "trainer0": {"step_mode": "graphed" if graphed else "eager"}}}]
    (out / "summary.json").write_text(json.dumps(summary))
    return str(out)


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    root = tmp_path_factory.mktemp("days")
    overlap = dict(policy="overlap", groups=2, sharing="mps")
    return [("a", [_run(root / "a-ovl", **overlap), _run(root / "a-sync", policy="shared-sync", sharing="mps"),
                   _run(root / "a-eager", graphed=False, **overlap)]),
            ("b", [_run(root / "b-ovl-low", "below-normal", NEW, **overlap),
                   _run(root / "b-sync", profile=NEW, policy="shared-sync", sharing="mps")])]


def test_each_profile_against_each_day_and_across_days(days):
    from experiments.crossday import crossday

    rep = crossday([(OLD, "a"), (NEW, "b")], days)
    old, new = rep["cells"][OLD], rep["cells"][NEW]
    # The eager-trainer run is another trainer than these profiles describe: left out.
    assert old["a"]["per_run"]["n"] == 2 and not any(r.endswith("a-eager") for r in old["a"]["runs"])
    # A run recorded by the simulator on a profile, replayed on that profile: no error.
    assert old["a"]["per_run"]["mape"] == pytest.approx(0, abs=1e-9)
    assert new["b"]["per_run"]["mape"] == pytest.approx(0, abs=1e-9)
    assert new["a"]["per_run"]["mape"] > 0.001
    # The below-normal overlap run is outside OLD's MPS rates: flagged, and left out where matched.
    assert old["b"]["mps_flagged"] == 1 and rep["matched"][OLD]["b"]["per_run"]["n"] == 1
    assert [r.rsplit("/", 1)[-1] for r in rep["matched"][OLD]["b"]["runs"]] == ["b-sync"]  # shared-sync: no priority
    # Across days: only the other day's runs, pooled.
    a = old["across_days"]
    assert a["runs"] == 2 and a["mape"] == pytest.approx(old["b"]["per_run"]["mape"]) == a["mape_per_day_mean"]
    assert rep["matched"][OLD]["across_days"]["runs"] == 1


def test_annotating_a_profile_carries_its_across_days_error(days, tmp_path, monkeypatch):
    import sim.profile as profile_mod
    from experiments.crossday import annotate, crossday
    from nodus.simulate import error_bar_line

    copy = tmp_path / f"{OLD}.json"
    shutil.copy(profile_mod.shipped_profile_path(OLD), copy)
    monkeypatch.setattr(profile_mod, "shipped_profile_path", lambda name: copy)
    rep = crossday([(OLD, "a")], days)
    assert annotate(rep, "crossday.md") == [str(copy)]
    v = profile_mod.load_profile(str(copy)).validation()
    a = rep["matched"][OLD]["across_days"]
    assert v["across_days_runs"] == 1 and v["across_days_mape"] == pytest.approx(a["mape"])
    assert v["heldout_mape"] is not None  # the in-day annotation is kept
    assert f"On 1 runs of other days: MAPE {a['mape']:.1%}" in error_bar_line(v)


def test_the_cli_names_a_day_that_matches_nothing(tmp_path):
    from experiments.crossday import main

    with pytest.raises(SystemExit):
        main(["--profile", OLD, "--day", f"x={tmp_path}/none*", "--out", str(tmp_path / "o")])


def test_annotating_needs_each_profiles_fit_day(days, tmp_path, capsys):
    from experiments.crossday import annotate, crossday, main

    with pytest.raises(SystemExit):
        main(["--profile", OLD, "--day", f"a={days[0][1][0]}", "--out", str(tmp_path / "o"), "--annotate"])
    assert "needs each profile's fit day" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has no fit day"):
        annotate(crossday([(OLD, None)], days[:1]), "x.md")


def test_an_in_place_validation_keeps_the_across_days_error(days, tmp_path):
    from calibration.validate import annotate_profile, validate
    from sim.profile import shipped_profile_path

    copy = tmp_path / "p.json"
    prof = json.loads(shipped_profile_path(OLD).read_text())
    prof["validation"] = dict(prof.get("validation") or {}, across_days_mape=0.05, across_days_runs=3)
    copy.write_text(json.dumps(prof))
    annotate_profile(str(copy), validate(days[0][1][:2], str(copy)), copy, "r.md")
    v = json.loads(copy.read_text())["validation"]
    assert v["across_days_mape"] == 0.05 and v["across_days_runs"] == 3 and v["report"] == "r.md"


def test_a_profile_meets_the_runs_of_its_engine_slots():
    """A profile that records its engine's adapter slots (environment.engine_max_loras) is compared
    on runs of those slots (a run's engine_max_loras control, else one per job); one that does not,
    on runs with one slot per job (session 23: 16 slots against 8 moved a run 11-27%)."""
    from experiments.crossday import comparable

    def row(jobs, slots=None):
        controls = {"trainer_step_mode": "graphed", "lora_kernels": "tuned"}
        return {"jobs": jobs, "controls": dict(controls, **({"engine_max_loras": slots} if slots else {}))}

    assert comparable(row(8), 8) and comparable(row(16, 8), 8)
    assert not comparable(row(16), 8) and not comparable(row(8, 16), 8)
    assert comparable(row(16)) and comparable(row(8)) and not comparable(row(16, 8))
    # A run whose engines' CPU threads were capped (--engine-cpu-threads) or whose trainers only partly
    # replayed their graphs: no profile here describes either.
    assert not comparable({"jobs": 8, "controls": dict(row(8)["controls"], engine_cpu_threads=1)})
    assert not comparable({"jobs": 8, "controls": dict(row(8)["controls"], trainer_step_mode="graphed 1 of 2")})
