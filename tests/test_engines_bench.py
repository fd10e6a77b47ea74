"""The two-engine bench (`nodus calibrate-engines`): two stacks' engines generating at once by engine
size, into ``sharing.engines_by_batch``, and the simulator's two-engine rate following it."""

import json

import pytest

from calibration.engines import adapters_for, calibrate_engines, engines_by_batch, measure_engines, write_raw
from nodus.cli import main
from nodus.config import STACKS_PROTOCOL_PROFILE
from nodus.simulate import config_from_args, simulate
from sim.gpu import engines_rate
from sim.profile import load_profile

P = f"calibration/profiles/{STACKS_PROTOCOL_PROFILE}.json"


class _StandIn:
    """Two engines whose generation takes ``alone(batch)`` seconds, ``beside(batch)`` beside the other
    (no processes; the bench's bookkeeping only)."""

    def __init__(self, slow: dict[int, float], made: list):
        self.slow, self.calls = slow, []
        made.append(self)

    def gen_request(self, batch, prompt, length, seqs_per_adapter):
        return (batch, adapters_for(batch, seqs_per_adapter))

    def alone(self, engine, work):
        self.calls.append(("alone", engine, work[0]))
        return 0.01 * work[0]

    def beside(self, engine, work):
        self.calls.append(("beside", engine, work[0]))
        return 0.01 * work[0] * self.slow[work[0]]

    def close(self):
        self.calls.append("closed")


def _bench(slow, **kw):
    made = []
    raw, settings = measure_engines("m", make_engines=lambda *a, **k: _StandIn(slow, made), log=lambda m: None,
                                    batches=sorted(slow), **kw)
    return raw, settings, made[0]


def test_the_bench_times_each_engine_alone_and_beside_the_other_and_keeps_every_bucket(tmp_path):
    raw_path = tmp_path / "b.raw.json"
    raw, settings, eng = _bench({64: 1.1, 512: 1.5}, repeats=2, raw_path=raw_path)
    rows = raw["mps"]
    assert [(r["batch"], r["adapters"]) for r in rows] == [(64, 1), (512, 8)]  # one adapter a job of 64
    assert [r["slowdown"] for r in rows] == pytest.approx([1.1, 1.5])
    # Each engine in the foreground `repeats` times, after one untimed generation of each shape on each.
    timed = [c for c in eng.calls[4:] if c != "closed"]
    assert timed[:8] == [("alone", 0, 64), ("alone", 1, 64)] * 2 + [("beside", 0, 64), ("beside", 1, 64)] * 2
    assert eng.calls[-1] == "closed"
    assert json.loads(raw_path.read_text())["raw"] == raw
    assert engines_by_batch(raw) == [{"batch": 64, "mps": pytest.approx(1.1)}, {"batch": 512, "mps": pytest.approx(1.5)}]


def _profile_with_bench(tmp_path, slow, base=P, name="b"):
    raw, settings, _ = _bench(slow)
    write_raw(tmp_path / f"{name}.raw.json", raw, settings)
    out = tmp_path / f"{name}.json"
    calibrate_engines(None, base, out, from_raw=tmp_path / f"{name}.raw.json", log=lambda m: None)
    return out


def test_the_fitted_two_engine_rate_holds_at_its_fit_size_and_follows_the_bench_elsewhere(tmp_path):
    out = _profile_with_bench(tmp_path, {64: 1.2, 128: 1.2, 256: 1.25, 512: 1.5})
    prof = json.loads(out.read_text())
    cost = load_profile(str(out)).profile.sharing
    fitted, fit_seqs = cost.mps_engines, cost.stacks_engine_sequences
    assert fit_seqs == 128 and fitted == json.loads(open(P).read())["sharing"]["mps_engines"]
    assert engines_rate("mps", cost, fit_seqs) == pytest.approx(fitted)
    assert engines_rate("mps", cost, 512) == pytest.approx(fitted * 1.2 / 1.5)
    assert engines_rate("mps", cost, 384) == pytest.approx(fitted * 1.2 / 1.375)  # linear between buckets
    assert engines_rate("mps", cost, 2048) == pytest.approx(fitted * 1.2 / 1.5)  # the largest bucket's beyond
    assert engines_rate("mps", cost, None) == fitted
    assert engines_rate("none", cost, 512) is None  # no time-sliced bucket measured
    assert any(a["id"] == "sharing-engines-by-batch" for a in prof["assumptions"])
    assert "validation" not in prof  # the base's error bar measured the base
    assert prof["environment"]["sources"][-1].startswith("nodus calibrate-engines --from-raw b.raw.json")


def test_a_bench_that_slows_big_engines_lowers_sixteen_jobs_and_leaves_four(tmp_path):
    out = _profile_with_bench(tmp_path, {64: 1.2, 128: 1.2, 256: 1.2, 512: 1.5})

    def sim(jobs, profile):
        return simulate(config_from_args(jobs=jobs, steps=3, policy="shared-sync", sharing="mps", stacks=2,
                                         profile=profile, share_prompts=4))

    for jobs in (4,):  # engines of 128 sequences: the fit's size, flat below it
        assert sim(jobs, str(out))["steps_per_gpu_hour"] == pytest.approx(sim(jobs, P)["steps_per_gpu_hour"])
    with_bench, without = sim(16, str(out)), sim(16, P)
    assert with_bench["steps_per_gpu_hour"] < 0.97 * without["steps_per_gpu_hour"]
    flags = " ".join(with_bench["diagnostics"][0]["outside_profile"])
    assert "the two-engine rate follows the bench" in flags and "past the two-engine bench" not in flags
    assert "its stacks rates fitted on smaller engines" in " ".join(without["diagnostics"][0]["outside_profile"])


def test_without_a_fitted_rate_the_bench_prices_two_engines_from_alone(tmp_path):
    base = tmp_path / "base.json"
    prof = json.loads(open(P).read())
    prof["sharing"]["mps_engines"] = None
    base.write_text(json.dumps(prof))
    out = _profile_with_bench(tmp_path, {64: 1.25, 512: 1.6}, base=str(base))
    cost = load_profile(str(out)).profile.sharing
    assert engines_rate("mps", cost, 64) == pytest.approx(cost.mps_alone.engine / 1.25)
    assert engines_rate("mps", cost, 512) == pytest.approx(cost.mps_alone.engine / 1.6)
    s = simulate(config_from_args(jobs=4, steps=2, policy="shared-sync", sharing="mps", stacks=2, profile=str(out),
                                  share_prompts=4))
    assert not any("no two-engine rate" in f for f in s["diagnostics"][0]["outside_profile"])


def test_timeslice_does_not_take_the_bench(tmp_path):
    out = _profile_with_bench(tmp_path, {64: 3.0, 512: 3.0})
    a = simulate(config_from_args(jobs=4, steps=2, policy="timeslice", profile=str(out), share_prompts=4))
    b = simulate(config_from_args(jobs=4, steps=2, policy="timeslice", profile=P, share_prompts=4))
    assert a["steps_per_gpu_hour"] == pytest.approx(b["steps_per_gpu_hour"])


def test_bad_input_to_calibrate_engines_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.raw.json"
    bad.write_text(json.dumps({"raw": {"mps": [{"batch": 64, "alone_s": 0, "beside_s": 1}]}, "settings": {}}))
    assert main(["calibrate-engines", "--from-raw", str(bad), "--base", P, "--out", str(tmp_path / "o.json")]) == 2
    assert "lacks a positive batch, alone_s or beside_s" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("not json")
    assert main(["calibrate-engines", "--from-raw", str(tmp_path / "junk.json"), "--out", str(tmp_path / "o.json")]) == 2
    assert "not a raw-timings file of calibrate-engines" in capsys.readouterr().err
    assert main(["calibrate-engines", "--modes", "mps,fast", "--model", "m", "--out", str(tmp_path / "o.json")]) == 2
    assert "choose from none,mps" in capsys.readouterr().err
    assert main(["calibrate-engines", "--out", str(tmp_path / "o.json")]) == 2
    assert "--model is required" in capsys.readouterr().err
    (tmp_path / "o.json").write_text("{}")
    assert main(["calibrate-engines", "--model", "m", "--out", str(tmp_path / "o.json")]) == 2
    assert "never overwrites" in capsys.readouterr().err
    assert not (tmp_path / "o.raw.json").exists()


def test_fit_stacks_on_a_base_with_the_bench_anchors_the_rate_at_its_runs_engine_size(tmp_path):
    """A flat bench up to the runs' engines changes nothing the fit sees: the same two-engine rate as
    without it, anchored at the runs' engine size; and a base without a recorded engine size (the
    bench alone would price the engines) still fits the rate it is given."""
    import glob

    runs = sorted(glob.glob("experiments/results/h200/session35/arms/*-ls4-*-j4-s?"))
    assert len(runs) == 2
    base = json.loads(open(P).read())
    base["sharing"]["stacks_engine_sequences"] = None
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(base))
    bench = _profile_with_bench(tmp_path, {64: 1.1, 128: 1.1, 512: 2.0}, base=str(plain))
    fits = {}
    for name, b in (("plain", plain), ("bench", bench)):
        out = tmp_path / f"fit-{name}.json"
        assert main(["fit-stacks", "--rate", "engines", "--no-left-out", "--base", str(b), "--out", str(out), *runs]) == 0
        fits[name] = json.loads(out.read_text())["sharing"]
    assert fits["bench"]["mps_engines"] == pytest.approx(fits["plain"]["mps_engines"], rel=1e-3)
    assert fits["bench"]["stacks_engine_sequences"] == fits["plain"]["stacks_engine_sequences"] == 128


def test_several_raw_files_pool_each_buckets_timings(tmp_path, capsys):
    a = {"raw": {"mps": [{"batch": 64, "adapters": 1, "alone_s": 1.0, "beside_s": 1.5, "alone_each_s": [1.0, 1.0],
                          "beside_each_s": [1.5, 1.5]}]},
         "settings": {"prompt": 128, "length": 256, "seqs_per_adapter": 64}}
    b = json.loads(json.dumps(a))
    b["raw"]["mps"][0].update(alone_each_s=[2.0, 2.0, 2.0], beside_each_s=[1.5, 1.5, 1.5], alone_s=2.0)
    (tmp_path / "a.raw.json").write_text(json.dumps(a))
    (tmp_path / "b.raw.json").write_text(json.dumps(b))
    out = tmp_path / "p.json"
    assert main(["calibrate-engines", "--from-raw", str(tmp_path / "a.raw.json"), str(tmp_path / "b.raw.json"),
                 "--base", P, "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    row = prof["measurements"]["engines"]["rows"]["mps"][0]
    assert row["alone_each_s"] == [1.0, 1.0, 2.0, 2.0, 2.0] and row["alone_s"] == 2.0  # the median of all five
    assert prof["sharing"]["engines_by_batch"] == [{"batch": 64, "mps": pytest.approx(0.75)}]
    assert "faster beside the other engine than alone (disturbed timings? measure again): mps 64" in capsys.readouterr().out
    assert "a.raw.json b.raw.json" in prof["environment"]["sources"][-1]
    b["settings"]["length"] = 128
    (tmp_path / "b.raw.json").write_text(json.dumps(b))
    assert main(["calibrate-engines", "--from-raw", str(tmp_path / "a.raw.json"), str(tmp_path / "b.raw.json"),
                 "--base", P, "--out", str(tmp_path / "q.json")]) == 2
    assert "length 128 against 256" in capsys.readouterr().err
