"""The host's handoff from a generation to its train step (train.handoff_s_per_*): the simulator
starting each train step that long after its generation, and `nodus fit-handoff` recovering known
terms from runs the simulator recorded with them."""

import json

import pytest

from calibration.handoff import fit, handoff_gaps
from nodus.cli import main
from nodus.config import AuditSpec, ConfigError
from nodus.simulate import config_from_args, simulate
from sim.profile import load_profile, profile_dict, write_profile

GRAPHED = "h200-xeon16-graphed-session16-qwen3-0.6b"
PER_SEQ, PER_AUDITED = 80e-6, 120e-6


def _profile(tmp_path, per_seq, per_audited, name="p.json"):
    prof = profile_dict(GRAPHED)
    prof["train"].update(handoff_s_per_sequence=per_seq, handoff_s_per_audited=per_audited)
    path = tmp_path / name
    write_profile(prof, path, "test")
    return str(path)


def _run(tmp_path, profile, name, jobs=2, policy="dedicated", **audit):
    cfg = config_from_args(jobs=jobs, steps=3, policy=policy, sharing="mps", profile=profile)
    if audit:
        cfg = cfg.model_copy(update={"audit": AuditSpec(**audit)})
    simulate(cfg, tmp_path / name)
    return tmp_path / name


def test_profiles_without_the_terms_start_the_train_at_once():
    t = load_profile(GRAPHED)
    assert t.profile.train.handoff_s_per_sequence == 0 and t.profile.train.handoff_s_per_audited == 0
    assert t.handoff_s(64, 64) == 0


def test_each_train_step_starts_its_handoff_after_its_generation(tmp_path):
    """A dedicated job of 64 sequences, every one audited, then auditing one response a prompt (8 of
    them): its train steps start 64 x 80 + 64 x 120 us = 12.8 ms and 64 x 80 + 8 x 120 us = 6.08 ms
    after its generations end; without the terms, at once."""
    p = _profile(tmp_path, PER_SEQ, PER_AUDITED)
    full = handoff_gaps(_run(tmp_path, p, "full"))
    light = handoff_gaps(_run(tmp_path, p, "light", responses=1))
    assert {r["sequences"] for r in full} == {64} and {r["audited"] for r in full} == {64}
    assert {r["audited"] for r in light} == {8}
    assert all(r["gap_s"] == pytest.approx(64 * PER_SEQ + 64 * PER_AUDITED, abs=1e-9) for r in full)
    assert all(r["gap_s"] == pytest.approx(64 * PER_SEQ + 8 * PER_AUDITED, abs=1e-9) for r in light)
    zero = handoff_gaps(_run(tmp_path, _profile(tmp_path, 0.0, 0.0, "z.json"), "zero"))
    assert all(abs(r["gap_s"]) < 1e-9 for r in zero)


def test_the_handoff_slows_a_dedicated_run_by_its_share_of_a_step(tmp_path):
    """Two dedicated jobs of three steps: each job's GPU is held 3 x 12.8 ms longer."""
    cfg = config_from_args(jobs=2, steps=3, policy="dedicated", sharing="mps", profile=GRAPHED)
    with_it = simulate(cfg.model_copy(update={"profile": _profile(tmp_path, PER_SEQ, PER_AUDITED)}))
    without = simulate(cfg.model_copy(update={"profile": _profile(tmp_path, 0.0, 0.0, "z.json")}))
    assert with_it["steps_per_gpu_hour"] < without["steps_per_gpu_hour"]
    assert with_it["gpu_seconds"] - without["gpu_seconds"] == pytest.approx(2 * 3 * 64 * (PER_SEQ + PER_AUDITED),
                                                                            rel=1e-6)


def test_fit_handoff_recovers_the_terms_the_runs_were_recorded_with(tmp_path):
    """Runs of two audits (every response, one a prompt) and two sizes (a dedicated job, a shared-sync
    group of two) tell the two terms apart; the written profile carries them and its assumption."""
    p = _profile(tmp_path, PER_SEQ, PER_AUDITED)
    runs = [_run(tmp_path, p, "ded-full"), _run(tmp_path, p, "ded-r1", responses=1),
            _run(tmp_path, p, "ss-full", policy="shared-sync"),
            _run(tmp_path, p, "ss-r1", policy="shared-sync", responses=1)]
    r = fit(runs)
    assert r["told_apart"]
    assert r["handoff_s_per_sequence"] == pytest.approx(PER_SEQ, rel=1e-6)
    assert r["handoff_s_per_audited"] == pytest.approx(PER_AUDITED, rel=1e-6)
    assert r["mape"] < 1e-6 and r["left_out_mape"] < 1e-6
    out = tmp_path / "fitted.json"
    assert main(["fit-handoff", *map(str, runs), "--base", GRAPHED, "--out", str(out),
                 "--report", str(tmp_path / "rep")]) == 0
    prof = json.loads(out.read_text())
    assert prof["train"]["handoff_s_per_sequence"] == pytest.approx(PER_SEQ, rel=1e-6)
    assert any(a["id"] == "handoff-linear" for a in prof["assumptions"])
    assert len(prof["measurements"]["handoff"]["rows"]) == 4
    assert (tmp_path / "rep.md").read_text().startswith("# The host's handoff")


def test_runs_of_one_audit_put_the_whole_gap_per_sequence(tmp_path, capsys):
    p = _profile(tmp_path, PER_SEQ, PER_AUDITED)
    runs = [_run(tmp_path, p, "a"), _run(tmp_path, p, "b", policy="shared-sync")]
    r = fit(runs)
    assert not r["told_apart"] and r["handoff_s_per_audited"] == 0
    assert r["handoff_s_per_sequence"] == pytest.approx(PER_SEQ + PER_AUDITED, rel=1e-6)
    assert main(["fit-handoff", *map(str, runs), "--base", GRAPHED, "--out", str(tmp_path / "o.json")]) == 0
    assert "the whole gap went per sequence" in capsys.readouterr().out


def test_bad_input_is_named(tmp_path, capsys):
    (tmp_path / "notarun").mkdir()
    with pytest.raises(ConfigError, match="is not a recorded run: config.json is missing"):
        fit([tmp_path / "notarun"])
    with pytest.raises(ConfigError, match="give recorded runs"):
        fit([])
    run = _run(tmp_path, GRAPHED, "r")
    (tmp_path / "exists.json").write_text("{}")
    assert main(["fit-handoff", str(run), "--base", GRAPHED, "--out", str(tmp_path / "exists.json")]) == 2
    assert "exists; nodus fit-handoff never overwrites a profile" in capsys.readouterr().err


def test_the_audit_counts_a_jobs_audited_sequences():
    full, r1, every2 = AuditSpec(), AuditSpec(responses=1), AuditSpec(every=2)
    assert full.audited(0, 64, 8) == 64 and r1.audited(0, 64, 8) == 8
    assert r1.audited(3, 20, 8) == 3  # two prompts of 8 and one of 4: one each
    assert every2.audited(1, 64, 8) == 0 and every2.audited(2, 64, 8) == 64
    assert AuditSpec(logprobs=False).audited(0, 64, 8) == 0


def test_a_term_the_runs_would_put_below_zero_is_left_out():
    """Runs where auditing more took less time (noise) would give the audited term a negative value:
    the fit keeps the sequence term alone, at what fits the rows best."""
    from calibration.handoff import _solve

    rows = [{"sequences": 64, "audited": 64, "gap_s": 0.010}, {"sequences": 64, "audited": 8, "gap_s": 0.012}]
    per_seq, per_audited, apart = _solve(rows)
    assert per_audited == 0 and apart
    assert 0.010 / 64 < per_seq < 0.012 / 64


def test_two_stacks_hand_off_by_a_factor_fitted_on_their_runs(tmp_path):
    """Runs recorded with a factor of 1.5 on two stacks: the one-stack runs give the two terms, the
    two-stack run the factor; the simulator applies it to runs of two stacks only."""
    prof = profile_dict(GRAPHED)
    prof["train"].update(handoff_s_per_sequence=PER_SEQ, handoff_s_per_audited=PER_AUDITED, handoff_stacks_factor=1.5)
    p = tmp_path / "f.json"
    write_profile(prof, p, "test")
    cfg = config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", profile=str(p))
    simulate(cfg.model_copy(update={"arm": cfg.arm.model_copy(update={"stacks": 2})}), tmp_path / "two")
    two = handoff_gaps(tmp_path / "two")
    assert {r["stacks"] for r in two} == {2}
    assert all(r["gap_s"] == pytest.approx(1.5 * r["sequences"] * (PER_SEQ + PER_AUDITED), abs=1e-9) for r in two)
    runs = [_run(tmp_path, str(p), "ded-full"), _run(tmp_path, str(p), "ded-r1", responses=1), tmp_path / "two"]
    r = fit(runs)
    assert r["handoff_stacks_factor"] == pytest.approx(1.5, rel=1e-6)
    assert r["handoff_s_per_sequence"] == pytest.approx(PER_SEQ, rel=1e-6) and r["mape"] < 1e-6
    # Without runs of one stack the terms come from all runs and the factor stays 1.
    assert fit([tmp_path / "two"])["handoff_stacks_factor"] == 1.0
