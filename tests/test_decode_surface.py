"""nodus calibrate's decode fit (no GPU, no vLLM): the physics-shaped surface its curves come from,
and --from-raw's refusals."""

import pytest

from nodus.cli import main


def test_the_decode_surface_is_monotone_and_names_points_off_it():
    """fit_decode_surface: a + b*batch + c*adapters + d*batch*adapters, each >= 0, by relative least
    squares; a point far off it (session 21's kind: more adapters measured faster) is named, and a
    profile's curves from it never fall with more sequences or adapters."""
    from calibration.measure import fit_decode_surface, fit_profile
    from sim.profile import Profile, profile_dict

    rows = [{"batch": b, "adapters": a, "step_s": 0.002 + 2e-5 * b + 1e-4 * a} for a in (1, 4, 8) for b in (8, 64, 256)]
    fit = fit_decode_surface(rows)
    assert fit["coef"]["a_s"] == pytest.approx(0.002, rel=1e-6) and fit["coef"]["b_s_per_seq"] == pytest.approx(2e-5)
    assert fit["coef"]["c_s_per_adapter"] == pytest.approx(1e-4) and fit["outliers"] == []
    noisy = [dict(r, step_s=r["step_s"] * (1.6 if (r["batch"], r["adapters"]) == (256, 4) else 1.0)) for r in rows]
    fit = fit_decode_surface(noisy)
    assert [(p["batch"], p["adapters"]) for p in fit["outliers"]] == [(256, 4)]
    raw = {"decode": noisy, "prefill": [{"tokens": 100, "s": 0.01}, {"tokens": 1000, "s": 0.05}],
           "train": [{"tokens": 4096, "adapters": 1, "s": 0.1}, {"tokens": 8192, "adapters": 2, "s": 0.2}],
           "context": [], "save_s": [0.01], "load_s": [0.02], "train_mb_tokens": 8192}
    base = profile_dict("h200-qwen3-0.6b")
    prof = fit_profile(raw, base, base["environment"])
    Profile.model_validate(prof)
    steps = {c["adapters"]: c["step_s"] for c in prof["decode"]["curves"]}
    assert all(x <= y for a in steps for x, y in zip(steps[a], steps[a][1:]))  # more sequences
    for j in range(3):  # more adapters
        by_adapters = [steps[a][j] for a in (1, 4, 8)]
        assert by_adapters == sorted(by_adapters)
    assert steps[4][2] < 0.8 * noisy[5]["step_s"]  # the point off the surface does not set its curve
    measured = fit_profile(raw, base, base["environment"], "points")
    assert {c["adapters"]: c["step_s"] for c in measured["decode"]["curves"]}[4][2] == noisy[5]["step_s"]
    # One adapter count: its terms stay 0, the batch's carry the fit.
    one = fit_decode_surface([r for r in rows if r["adapters"] == 4])
    assert one["coef"]["c_s_per_adapter"] == one["coef"]["d_s_per_seq_adapter"] == 0
    assert one["coef"]["b_s_per_seq"] == pytest.approx(2e-5)
    with pytest.raises(ValueError, match="decode model 'spline'"):
        fit_profile(raw, base, base["environment"], "spline")


def _calibrated(tmp_path):
    """A profile as nodus calibrate writes it, from synthetic measurements (one 4-adapter point 60% off)."""
    from calibration.measure import fit_profile
    from sim.profile import profile_dict, write_profile

    rows = [{"batch": b, "adapters": a, "step_s": (0.002 + 2e-5 * b + 1e-4 * a) * (1.6 if (b, a) == (256, 4) else 1)}
            for a in (1, 4, 8) for b in (8, 64, 256)]
    raw = {"decode": rows, "prefill": [{"tokens": 100, "s": 0.01}, {"tokens": 1000, "s": 0.05}],
           "train": [{"tokens": 4096, "adapters": 1, "s": 0.1}, {"tokens": 8192, "adapters": 2, "s": 0.2}],
           "context": [], "save_s": [0.01], "load_s": [0.02], "train_mb_tokens": 8192}
    base = profile_dict("h200-qwen3-0.6b")
    env = {"gpu": "test GPU", "model": "m", "date": "2026-12-01", "sources": ["nodus calibrate"], "engine_max_loras": 8}
    path = tmp_path / "cal.json"
    write_profile(fit_profile(raw, base, env, "points"), path, "test")
    return path, rows


def test_calibrate_from_raw_refits_a_calibration_and_names_the_refit(tmp_path, capsys):
    import json

    path, rows = _calibrated(tmp_path)
    out = tmp_path / "surface.json"
    assert main(["calibrate", "--from-raw", str(path), "--out", str(out)]) == 0
    prof, old = json.loads(out.read_text()), json.loads(path.read_text())
    assert prof["environment"]["sources"] == [
        "nodus calibrate", "nodus calibrate --from-raw cal.json (decode model surface)"]
    assert prof["environment"]["engine_max_loras"] == 8 and prof["sharing"] == old["sharing"]
    assert prof["measurements"]["calibrate"]["decode"] == rows  # the measured points kept
    assert [(p["batch"], p["adapters"]) for p in prof["measurements"]["decode_fit"]["outliers"]] == [(256, 4)]
    assert "decode point off the surface by -3" in capsys.readouterr().err  # named as it is fitted


def test_calibrate_from_raw_refuses_what_it_cannot_refit(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["calibrate", "--from-raw", "calibration/profiles/h200-qwen3-0.6b-provisional.json",
                 "--out", str(out)]) == 2
    assert "not a profile nodus calibrate wrote" in capsys.readouterr().err and not out.exists()
    # A calibration fitted since (nodus fit): a refit of its measurements would drop the fit.
    assert main(["calibrate", "--from-raw", "calibration/profiles/h200-xeon16-graphed-session21-qwen3-0.6b.json",
                 "--out", str(out)]) == 2
    assert "changed since its calibration (nodus fit on 2 run(s);" in capsys.readouterr().err and not out.exists()
    path, _ = _calibrated(tmp_path)
    assert main(["calibrate", "--from-raw", str(path), "--out", str(out), "--engine-slots", "16"]) == 2
    assert "--from-raw refits measurements already taken: --engine-slots" in capsys.readouterr().err
    assert main(["calibrate", "--out", str(out)]) == 2
    assert "--model (a local model folder to measure) or --from-raw" in capsys.readouterr().err
    assert not out.exists()


def test_calibrate_refuses_fewer_engine_slots_than_adapters_before_loading(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["calibrate", "--model", str(tmp_path / "no-model"), "--out", str(out), "--adapters", "1,4",
                 "--engine-slots", "2", "--device", "cpu"]) == 2
    assert "--engine-slots 2: fewer than the 4 adapters" in capsys.readouterr().err and not out.exists()
