"""The on-policy audit as a run setting (RunConfig.audit): the simulator pricing it by the profile's
decode.logprob_s_per_seq, `nodus fit-audit` recovering a known term from runs the simulator recorded
with it, and the real backend's options and config kept as one audit."""

import json
import shutil
from pathlib import Path

import pytest

from calibration.audit import audit_pairs, fit, fit_to_file
from calibration.run_health import unique_names
from calibration.validate import validate
from nodus.cli import main
from nodus.config import AuditSpec, ConfigError, build_config
from nodus.simulate import config_from_args, simulate
from sim.profile import load_profile, profile_dict, write_profile

GRAPHED = "h200-xeon16-graphed-session16-qwen3-0.6b"
TERM = 12e-6  # seconds a sequence returning its logprob adds to a decode step (session 32 fitted 13.5 us)


def _profile(tmp_path, term, name="p.json"):
    prof = profile_dict(GRAPHED)
    prof["decode"]["logprob_s_per_seq"] = term
    path = tmp_path / name
    write_profile(prof, path, "test")
    return str(path)


def _cfg(profile, **audit):
    cfg = config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", profile=profile)
    return cfg.model_copy(update={"audit": AuditSpec(**audit)}) if audit else cfg


def test_audit_spec_counts_the_responses_that_ask_and_refuses_bad_values():
    full, r1, every2, none = AuditSpec(), AuditSpec(responses=1), AuditSpec(every=2), AuditSpec(logprobs=False)
    assert full.is_full() and not r1.is_full() and not none.is_full()
    assert [full.asking(s, 8) for s in (0, 1)] == [8, 8]
    assert [r1.asking(s, 8) for s in (0, 1)] == [1, 1] and AuditSpec(responses=12).asking(0, 8) == 8
    assert [every2.asking(s, 8) for s in (0, 1, 2)] == [8, 0, 8]
    assert none.asking(0, 8) == 0
    # No audit is one setting: its cadence is dropped, and a bad one is still refused.
    assert AuditSpec(logprobs=False, every=4, responses=2) == none
    with pytest.raises(ValueError, match="every"):
        AuditSpec(logprobs=False, every=0)
    base = {"jobs": [{"task": "gsm8k"}, {"task": "countdown"}]}
    assert build_config(base).audit == full
    for bad, field in (({"every": 0}, "audit.every"), ({"responses": 0}, "audit.responses"),
                       ({"sometimes": 1}, "audit.sometimes")):
        with pytest.raises(ConfigError, match=field):
            build_config({**base, "audit": bad})
    assert build_config({**base, "audit": {"responses": 1}}).audit == r1


def test_the_simulator_prices_fewer_logprobs_faster_and_flags_a_profile_without_the_term(tmp_path):
    p = _profile(tmp_path, TERM)
    sph = {name: simulate(_cfg(p, **a))["steps_per_gpu_hour"]
           for name, a in (("full", {}), ("every2", {"every": 2}), ("r1", {"responses": 1}),
                           ("none", {"logprobs": False}))}
    assert sph["full"] < sph["every2"] < sph["none"]
    assert sph["full"] < sph["r1"] < sph["none"]
    # The full audit is the profile's own curves: the term changes nothing there.
    assert simulate(_cfg(_profile(tmp_path, 0.0, "zero.json")))["steps_per_gpu_hour"] == pytest.approx(sph["full"])
    # Without the term a lighter audit is priced as the full one, and said so.
    out = simulate(_cfg(_profile(tmp_path, 0.0, "zero2.json"), responses=1))
    assert out["steps_per_gpu_hour"] == pytest.approx(sph["full"])
    flags = " ".join(out["outside_profile"])
    assert "audit=1 response a prompt" in flags and "nodus fit-audit" in flags
    assert not any("audit" in f for f in simulate(_cfg(p, responses=1))["outside_profile"])


def test_the_cost_model_never_takes_a_step_below_half():
    cost = load_profile(GRAPHED)
    full = cost.decode_step_s(256, 0.0, 4)
    assert cost.decode_step_s(256, 0.0, 4, logprob_seqs=256) == full
    assert cost.decode_step_s(256, 0.0, 4, logprob_seqs=0) == full  # no term in the profile
    cost.profile.decode.__dict__["logprob_s_per_seq"] = 1.0  # absurdly large
    assert cost.decode_step_s(256, 0.0, 4, logprob_seqs=0) == pytest.approx(0.5 * full)


def _record_pair(tmp_path, term, seed=1, jobs=4, tag=""):
    """A full-audit run and a one-response-a-prompt run the simulator recorded with ``term``."""
    p = _profile(tmp_path, term, f"truth{tag}.json")
    out = []
    for name, a in (("full", {}), ("r1", {"responses": 1})):
        cfg = config_from_args(jobs=jobs, steps=2, policy="shared-sync", sharing="mps", seed=seed, profile=p)
        cfg = cfg.model_copy(update={"audit": AuditSpec(**a)})
        simulate(cfg, tmp_path / f"{name}{tag}")
        out.append(str(tmp_path / f"{name}{tag}"))
    return out


def test_fit_audit_recovers_the_term_the_runs_were_recorded_with(tmp_path):
    runs = _record_pair(tmp_path, TERM) + _record_pair(tmp_path, TERM, seed=2, jobs=8, tag="b")
    r = fit(runs, _profile(tmp_path, 0.0, "truth-without.json"))
    assert r["logprob_s_per_seq"] == pytest.approx(TERM, rel=0.02)
    assert all(abs(x["ratio_error"]) < 0.005 for x in r["rows"])
    # A base that misprices both runs of a pair alike (its decode 20% slow, so every run ~15% under):
    # the fit still matches the pairs' ratios, which is all it fits.
    prof = profile_dict(GRAPHED)
    prof["decode"]["scale"] *= 1.2
    base = tmp_path / "base.json"
    write_profile(prof, base, "test")
    r = fit(runs, str(base))
    assert r["logprob_s_per_seq"] == pytest.approx(TERM, rel=0.15)
    assert all(abs(x["ratio_error"]) < 0.01 for x in r["rows"])
    assert all(x["left_out"] and abs(x["left_out"]["error"]) < 0.02 for x in r["rows"])
    out = tmp_path / "fitted.json"
    assert main(["fit-audit", *runs, "--base", str(base), "--out", str(out), "--report", str(tmp_path / "rep")]) == 0
    fitted = json.loads(out.read_text())
    assert fitted["decode"]["logprob_s_per_seq"] == pytest.approx(r["logprob_s_per_seq"])
    assert "audit-logprob-term" in {a["id"] for a in fitted["assumptions"]}
    assert "| 1 response a prompt |" in (tmp_path / "rep.md").read_text()
    with pytest.raises(FileExistsError, match="never overwrites"):
        fit_to_file(runs, str(base), out)
    # A report prefix whose JSON is the profile itself is refused before any replay, the profile unwritten.
    clash = tmp_path / "clash"
    assert main(["fit-audit", *runs, "--base", str(base), "--out", f"{clash}.json", "--report", str(clash)]) == 2
    assert not (tmp_path / "clash.json").exists()
    # validate prices the lighter run on the fitted profile, and no longer calls its audit unmodelled.
    res = validate(runs[:2], str(out))
    light = next(r for r in res["rows"] if r["run"].endswith("r1"))
    assert not any("audit" in f for f in light["outside_profile"])
    full_row = next(r for r in res["rows"] if r["run"].endswith("full"))
    ratio = lambda row, k: row[k]["steps_per_gpu_hour"]  # noqa: E731
    assert ratio(light, "replay") / ratio(full_row, "replay") == pytest.approx(
        ratio(light, "measured") / ratio(full_row, "measured"), rel=0.01)
    # The two audits stay two configurations though the profile prices both (per-configuration
    # errors, the noise floor): a lighter audit is no repeat of the full one.
    assert (light["audit"], full_row["audit"]) == ("r1", "")
    assert res["all_per_config"]["replay"]["n"] == 2 and res["all_per_config"]["runs_per_config"] == [1, 1]
    assert any(c.endswith("audit r1") for c in res["all_per_config"]["configs"])


def test_fit_audit_refuses_unpaired_repeated_and_doubled_runs(tmp_path):
    full, light = _record_pair(tmp_path, TERM)
    with pytest.raises(ConfigError, match="has no partner"):
        audit_pairs([full])
    with pytest.raises(ConfigError, match="again"):
        audit_pairs([full, full, light])
    with pytest.raises(ConfigError, match="has no partner.*full audit"):
        audit_pairs([light])
    # A full-audit run pairs with each lighter audit of its configuration.
    cfg = build_config(json.loads((tmp_path / "full" / "config.json").read_text()))
    simulate(cfg.model_copy(update={"audit": AuditSpec(logprobs=False)}), tmp_path / "none")
    pairs = audit_pairs([full, light, str(tmp_path / "none")])
    assert [(p["full"]["run"], p["light"]["audit"]["logprobs"]) for p in pairs] == [(full, False), (full, True)]
    # A repeat of the full-audit run (its spans written apart, so another run to the digest).
    other = tmp_path / "full-again"
    shutil.copytree(full, other)
    spans = other / "spans.jsonl"
    spans.write_text("".join(json.dumps(json.loads(x), separators=(",", ":")) + "\n"
                             for x in spans.read_text().splitlines()))
    with pytest.raises(ConfigError, match=r"both runs of one configuration with one audit \(full\) in one folder"):
        audit_pairs([full, str(other), light])
    # Another day's pair of the same configuration, in a folder of its own: each day pairs apart.
    day2 = tmp_path / "day2"
    day2.mkdir()
    for name, src in (("full", other), ("light", Path(light))):
        shutil.copytree(src, day2 / name)
    spans = day2 / "light" / "spans.jsonl"
    spans.write_text("".join(json.dumps(json.loads(x), separators=(",", ":")) + "\n"
                             for x in spans.read_text().splitlines()))
    pairs = audit_pairs([full, light, str(day2 / "full"), str(day2 / "light")])
    assert sorted((p["full"]["run"], p["light"]["run"]) for p in pairs) == sorted(
        [(full, light), (str(day2 / "full"), str(day2 / "light"))])
    with pytest.raises(ConfigError, match="day2/full has no partner"):
        audit_pairs([full, light, str(day2 / "full")])
    # The report names each run by the shortest path no other run shares.
    assert unique_names(["r/session32/arms/x", "r/session33/arms/x", "r/session33/arms/y"]) == [
        "session32/arms/x", "session33/arms/x", "y"]


def test_the_sim_cli_takes_the_audit_flags_and_names_a_bad_one(tmp_path, capsys):
    p = _profile(tmp_path, TERM)
    assert main(["sim", "--jobs", "4", "--steps", "2", "--profile", p, "--audit-responses", "1",
                 "--out", str(tmp_path / "r")]) == 0
    assert json.loads((tmp_path / "r" / "config.json").read_text())["audit"] == {
        "logprobs": True, "every": 1, "responses": 1}
    for flags, what in ((["--audit-every", "0"], "--audit-every 0"),
                        (["--audit-responses", "0"], "--audit-responses 0")):
        assert main(["sim", "--jobs", "2", "--steps", "1", *flags]) == 2
        assert what in capsys.readouterr().err


def test_the_real_backend_keeps_one_audit_in_its_config_and_options():
    from real.backend import BackendConfigError, RealOptions, check_run_settings, with_audit

    cfg = _cfg(GRAPHED)
    r1 = AuditSpec(responses=1)
    got_cfg, got_opts = with_audit(cfg, RealOptions(audit_responses=1))
    assert got_cfg.audit == r1 and got_opts.audit_responses == 1
    got_cfg, got_opts = with_audit(cfg.model_copy(update={"audit": r1}), RealOptions())
    assert got_cfg.audit == r1 and got_opts.audit_responses == 1 and got_opts.audit_logprobs
    with pytest.raises(BackendConfigError, match="set one"):
        with_audit(cfg.model_copy(update={"audit": r1}), RealOptions(audit_every=2))
    with pytest.raises(BackendConfigError, match="audit"):
        check_run_settings(cfg, RealOptions(audit_logprobs=False))


def test_a_sweep_runs_every_arm_and_its_baseline_under_one_audit(tmp_path):
    from nodus.simulate import sweep

    p = _profile(tmp_path, TERM)
    kw = dict(jobs="4", groups="1", policies="shared-sync", sharing="mps", seeds="1", steps=2, profile=p,
              workers=1, progress=False)
    full, r1 = sweep(**kw), sweep(**kw, audit=AuditSpec(responses=1))
    assert r1["audit"] == {"logprobs": True, "every": 1, "responses": 1} and full["audit"]["responses"] is None
    sph = {(res["audit"]["responses"], r["policy"]): r["steps_per_gpu_hour"] for res in (full, r1) for r in res["rows"]}
    assert sph[(1, "shared-sync")] > sph[(None, "shared-sync")] and sph[(1, "dedicated")] > sph[(None, "dedicated")]
    assert main(["sweep", "--jobs", "2", "--groups", "1", "--policies", "shared-sync", "--sharing", "mps",
                 "--seeds", "1", "--steps", "1", "--profile", p, "--workers", "1", "--no-audit", "--json"]) == 0
