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
    """Two stacks whose engine's generation takes ``0.01 * batch`` seconds alone, ``slow[batch]`` times
    that beside the other engine and ``by_trainer[batch]`` times it beside the other stack's trainer
    (no processes; the bench's bookkeeping only)."""

    def __init__(self, slow: dict[int, float], made: list, by_trainer: dict[int, float] | None = None):
        self.slow, self.by_trainer, self.calls = slow, by_trainer or {b: 1.1 for b in slow}, []
        made.append(self)

    def gen_request(self, batch, prompt, length, seqs_per_adapter):
        return (batch, adapters_for(batch, seqs_per_adapter))

    def train_request(self, batch, prompt, length, seqs_per_adapter):
        return ("train", batch, adapters_for(batch, seqs_per_adapter), prompt + length)

    def alone(self, engine, work):
        self.calls.append(("alone", engine, work[0]))
        return 0.01 * work[0]

    def beside(self, engine, work):
        self.calls.append(("beside", engine, work[0]))
        return 0.01 * work[0] * self.slow[work[0]]

    def train_alone(self, stack, train):
        self.calls.append(("train", stack, train[1]))
        return 0.002 * train[1]

    def beside_trainer(self, engine, work, train):
        assert train[1] == work[0]  # the trainer steps over the engine's own number of sequences
        self.calls.append(("beside_trainer", engine, work[0]))
        return 0.01 * work[0] * self.by_trainer[work[0]]

    def trainer_beside(self, stack, train, work):
        assert train[1] == work[0]
        self.calls.append(("trainer_beside", stack, work[0]))
        return 0.002 * train[1] * (1 + self.by_trainer[work[0]]) / 2  # the trainer slowed half as much

    def close(self):
        self.calls.append("closed")


def _bench(slow, by_trainer=None, **kw):
    made = []
    raw, settings = measure_engines("m", make_engines=lambda *a, **k: _StandIn(slow, made, by_trainer),
                                    log=lambda m: None, batches=sorted(slow), **kw)
    return raw, settings, made[0]


def test_the_bench_times_each_engine_alone_beside_the_other_and_beside_its_trainer_and_keeps_every_bucket(tmp_path):
    raw_path = tmp_path / "b.raw.json"
    raw, settings, eng = _bench({64: 1.1, 512: 1.5}, {64: 1.3, 512: 1.8}, repeats=2, raw_path=raw_path)
    rows = raw["mps"]
    assert [(r["batch"], r["adapters"]) for r in rows] == [(64, 1), (512, 8)]  # one adapter a job of 64
    assert [r["slowdown"] for r in rows] == pytest.approx([1.1, 1.5])
    assert [r["trainer_slowdown"] for r in rows] == pytest.approx([1.3, 1.8])
    assert [r["train_alone_s"] for r in rows] == pytest.approx([0.128, 1.024])
    # One untimed generation of each shape on each engine and one step of each on each trainer first;
    # then each engine in the foreground `repeats` times of each kind, the kinds interleaved (a drift
    # through the bucket falls on alone and beside times alike).
    assert eng.calls[:8] == [("alone", 0, 64), ("alone", 1, 64), ("alone", 0, 512), ("alone", 1, 512),
                             ("train", 0, 64), ("train", 1, 64), ("train", 0, 512), ("train", 1, 512)]
    timed = [c for c in eng.calls[8:] if c != "closed"]
    kinds = ["alone", "beside", "train", "beside_trainer", "trainer_beside"]
    assert timed[:20] == [(kind, e, 64) for _ in range(2) for e in (0, 1) for kind in (kinds if e == 0 else kinds[::-1])]
    assert len(timed) == 40 and {c[2] for c in timed[20:]} == {512}
    assert eng.calls[-1] == "closed"
    assert json.loads(raw_path.read_text())["raw"] == raw
    assert settings["beside"] == ["engine", "trainer"]
    assert [r["train_slowdown"] for r in rows] == pytest.approx([1.15, 1.4])
    assert engines_by_batch(raw) == [
        {"batch": 64, "mps": pytest.approx(1.1), "mps_beside_trainer": pytest.approx(1.3),
         "mps_trainer_beside": pytest.approx(1.15)},
        {"batch": 512, "mps": pytest.approx(1.5), "mps_beside_trainer": pytest.approx(1.8),
         "mps_trainer_beside": pytest.approx(1.4)}]


class _Drifting(_StandIn):
    """A stand-in whose every timing in a bucket runs 2% faster than the one before (from 1.2x), as
    the H100's engines' alone times fell through a bucket (sessions 60-61)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.i, self.batch = 0, None

    def _drift(self, batch, seconds):
        if batch != self.batch:
            self.i, self.batch = 0, batch
        self.i += 1
        return seconds * (1.2 - 0.02 * (self.i - 1))

    def alone(self, engine, work):
        return self._drift(work[0], super().alone(engine, work))

    def beside(self, engine, work):
        return self._drift(work[0], super().beside(engine, work))


def test_a_drift_through_a_bucket_falls_on_alone_and_beside_times_alike():
    """Timed kind by kind (four alone, then four beside) the drift above makes a 1.5x slowdown 1.39x;
    interleaved, every other pass reversed, 1.5x within 0.5%."""
    made = []
    raw, _ = measure_engines("m", make_engines=lambda *a, **k: _Drifting({64: 1.5}, made), log=lambda m: None,
                             batches=[64], beside=("engine",))
    assert raw["mps"][0]["slowdown"] == pytest.approx(1.5, rel=0.005)


def test_the_bench_beside_one_kind_only_times_that_kind(tmp_path):
    raw, settings, eng = _bench({64: 1.1, 128: 1.2}, beside=("engine",))
    assert not any(c[0] in ("train", "beside_trainer") for c in eng.calls if c != "closed")
    assert engines_by_batch(raw) == [{"batch": 64, "mps": pytest.approx(1.1)}, {"batch": 128, "mps": pytest.approx(1.2)}]
    raw, settings, eng = _bench({64: 1.1, 128: 1.2}, {64: 1.4, 128: 1.6}, beside=("trainer",))
    assert not any(c[0] == "beside" for c in eng.calls if c != "closed")
    assert engines_by_batch(raw) == [{"batch": 64, "mps_beside_trainer": pytest.approx(1.4),
                                      "mps_trainer_beside": pytest.approx(1.2)},
                                     {"batch": 128, "mps_beside_trainer": pytest.approx(1.6),
                                      "mps_trainer_beside": pytest.approx(1.3)}]


def _on_base(base) -> dict:
    """measure_engines' settings a bench on ``base`` runs under (what calibrate_engines passes)."""
    from calibration.engines import base_settings
    from sim.profile import profile_dict

    want = base_settings(profile_dict(base))
    return {k: want[k] for k in ("cuda_graph_max_tokens", "tuned_lora_kernels", "trainer_graphs", "controls")}


def _profile_with_bench(tmp_path, slow, base=P, name="b", by_trainer=None, beside=("engine",)):
    raw, settings, _ = _bench(slow, by_trainer, beside=beside, **_on_base(base))
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


def test_the_flag_past_the_fit_size_names_what_keeps_it_in_agreement(tmp_path):
    """On a base without the two trainers' rate, an engine-only bench leaves the lone trainer's rates
    (plural) at the fit's size: the flag says they keep it (session 61's wording said 'keeps')."""
    base = json.loads(open(P).read())
    base["sharing"]["mps_trainers"] = None
    (tmp_path / "no2.json").write_text(json.dumps(base))
    out = _profile_with_bench(tmp_path, {64: 1.2, 128: 1.2, 256: 1.2, 512: 1.5}, base=str(tmp_path / "no2.json"))
    got = simulate(config_from_args(jobs=16, steps=3, policy="shared-sync", sharing="mps", stacks=2,
                                    profile=str(out), share_prompts=4))
    flags = " ".join(got["diagnostics"][0]["outside_profile"])
    assert ("the two-engine rate follows the bench; the rates of a lone trainer and an engine beside it keep the "
            "fit's engine size") in flags


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


def _from_raw(tmp_path, out, *docs) -> int:
    """`nodus calibrate-engines --from-raw` on raw-timings documents written as r0.raw.json, r1..."""
    files = []
    for k, doc in enumerate(docs):
        files.append(tmp_path / f"r{k}.raw.json")
        files[-1].write_text(json.dumps(doc))
    return main(["calibrate-engines", "--from-raw", *map(str, files), "--base", P, "--out", str(out)])


def test_several_raw_files_pool_each_buckets_timings(tmp_path, capsys):
    a = {"raw": {"mps": [{"batch": 64, "adapters": 1, "alone_s": 1.0, "beside_s": 1.5, "alone_each_s": [1.0, 1.0],
                          "beside_each_s": [1.5, 1.5]}]},
         "settings": {"prompt": 128, "length": 256, "seqs_per_adapter": 64}}
    b = json.loads(json.dumps(a))
    b["raw"]["mps"][0].update(alone_each_s=[2.0, 2.0, 2.0], beside_each_s=[1.5, 1.5, 1.5], alone_s=2.0)
    out = tmp_path / "p.json"
    assert _from_raw(tmp_path, out, a, b) == 0
    prof = json.loads(out.read_text())
    row = prof["measurements"]["engines"]["rows"]["mps"][0]
    assert row["alone_each_s"] == [1.0, 1.0, 2.0, 2.0, 2.0] and row["alone_s"] == 2.0  # the median of all five
    assert prof["sharing"]["engines_by_batch"] == [{"batch": 64, "mps": pytest.approx(0.75)}]
    assert "faster beside than alone (disturbed timings? measure again): mps slowdown beside the other engine at 64" in capsys.readouterr().out
    assert "r0.raw.json r1.raw.json" in prof["environment"]["sources"][-1]
    b["settings"]["length"] = 128
    assert _from_raw(tmp_path, tmp_path / "q.json", a, b) == 2
    assert "length 128 against 256" in capsys.readouterr().err


def test_an_engine_beside_the_other_stacks_trainer_follows_the_bench_from_the_fitted_rate(tmp_path):
    from sim.gpu import sharing_rates, stacks_engine_rate, stacks_trainer_rate

    out = _profile_with_bench(tmp_path, {64: 1.2, 128: 1.2, 256: 1.2, 512: 1.2},
                              by_trainer={64: 1.5, 128: 1.5, 256: 1.6, 512: 2.0}, beside=("engine", "trainer"))
    prof = json.loads(out.read_text())
    cost = load_profile(str(out)).profile.sharing
    fitted = cost.mps_stacks_engine
    assert fitted == json.loads(open(P).read())["sharing"]["mps_stacks_engine"] and cost.stacks_engine_sequences == 128
    assert stacks_engine_rate("mps", cost, 128) == pytest.approx(fitted)  # the fit's level at its engine size
    assert stacks_engine_rate("mps", cost, 512) == pytest.approx(fitted * 1.5 / 2.0)
    assert stacks_engine_rate("mps", cost, None) == fitted
    assert stacks_engine_rate("none", cost, 512) is None  # time-sliced stacks keep the pair's rates
    # The lone trainer beside that engine: the bench's trainer slowdown 1.25 at 128 sequences, 1.5 at 512.
    lone = cost.mps_stacks_trainer
    assert stacks_trainer_rate("mps", cost, 128) == pytest.approx(lone)
    assert stacks_trainer_rate("mps", cost, 512) == pytest.approx(lone * 1.25 / 1.5)
    # In the simulator's clients: one engine beside the other stack's lone trainer, and two engines beside it.
    assert sharing_rates(["engine", "trainer"], "mps", cost, 512) == pytest.approx([fitted * 0.75, lone * 1.25 / 1.5])
    two = sharing_rates(["engine", "engine", "trainer"], "mps", cost, 512)
    assert two[0] == pytest.approx(cost.mps_engines * fitted * 0.75 / cost.mps_alone.engine)
    assert any(a["id"] == "sharing-engine-beside-trainer-by-batch" for a in prof["assumptions"])
    # Without a fitted rate: the MPS alone rate over the bench's slowdown.
    base = json.loads(open(P).read())
    base["sharing"]["mps_stacks_engine"] = None
    (tmp_path / "nofit.json").write_text(json.dumps(base))
    out2 = _profile_with_bench(tmp_path, {64: 1.2}, by_trainer={64: 1.6}, base=str(tmp_path / "nofit.json"),
                               name="n", beside=("trainer",))
    cost2 = load_profile(str(out2)).profile.sharing
    assert stacks_engine_rate("mps", cost2, 64) == pytest.approx(cost2.mps_alone.engine / 1.6)


def test_a_trainer_bench_that_slows_big_engines_lowers_sixteen_jobs_on_stacks_only(tmp_path):
    out = _profile_with_bench(tmp_path, {64: 1.2, 128: 1.2, 256: 1.2, 512: 1.2},
                              by_trainer={64: 1.5, 128: 1.5, 256: 1.5, 512: 3.0}, beside=("engine", "trainer"))
    flat = _profile_with_bench(tmp_path, {64: 1.2, 128: 1.2, 256: 1.2, 512: 1.2}, name="flat")

    def sim(jobs, profile, stacks=2):
        # Offset stacks: one stack's engine generates while the other's trainer trains alone.
        return simulate(config_from_args(jobs=jobs, steps=3, policy="shared-sync", sharing="mps", stacks=stacks,
                                         offset_stacks=stacks > 1, profile=profile, share_prompts=4))

    assert sim(4, str(out))["steps_per_gpu_hour"] == pytest.approx(sim(4, str(flat))["steps_per_gpu_hour"])
    slow, plain = sim(16, str(out)), sim(16, str(flat))
    assert slow["steps_per_gpu_hour"] < 0.99 * plain["steps_per_gpu_hour"]
    flags = " ".join(slow["diagnostics"][0]["outside_profile"])
    assert ("the two-engine rate and the rates of a lone trainer and an engine beside it follow the bench; the two "
            "trainers' rate keeps the fit's engine size") in flags
    assert "the rates of a lone trainer and an engine beside it and the two trainers' rate keep" in " ".join(
        plain["diagnostics"][0]["outside_profile"])
    # One stack has no other stack's trainer: its engine beside its own trainer keeps the pair's rates.
    assert sim(16, str(out), stacks=1)["steps_per_gpu_hour"] == pytest.approx(sim(16, str(flat), stacks=1)["steps_per_gpu_hour"])


def test_trainer_rows_pool_and_bad_ones_are_named(tmp_path, capsys):
    row = {"batch": 64, "adapters": 1, "alone_s": 1.0, "beside_trainer_s": 1.5, "alone_each_s": [1.0, 1.0],
           "beside_trainer_each_s": [1.5, 1.5], "train_alone_s": 0.5, "train_alone_each_s": [0.5, 0.5],
           "train_beside_s": 0.6, "train_beside_each_s": [0.6, 0.6]}
    a = {"raw": {"mps": [row]}, "settings": {"prompt": 128, "length": 256, "seqs_per_adapter": 64,
                                             "trainer_graphs": True}}
    b = json.loads(json.dumps(a))
    b["raw"]["mps"][0].update(beside_trainer_each_s=[2.5, 2.5, 2.5], beside_trainer_s=2.5)
    out = tmp_path / "p.json"
    assert _from_raw(tmp_path, out, a, b) == 0
    prof = json.loads(out.read_text())
    assert prof["sharing"]["engines_by_batch"] == [{"batch": 64, "mps_beside_trainer": pytest.approx(2.5),
                                                    "mps_trainer_beside": pytest.approx(1.2)}]
    assert prof["measurements"]["engines"]["settings"]["beside"] == ["trainer"]
    ids = [a["id"] for a in prof["assumptions"]]  # no two-engine timing, no two-engine assumption
    assert "sharing-engine-beside-trainer-by-batch" in ids and "sharing-engines-by-batch" not in ids
    assert "batch 64: mps beside the other stack's trainer 2.500" in capsys.readouterr().out
    b["settings"]["trainer_graphs"] = False
    assert _from_raw(tmp_path, tmp_path / "q.json", a, b) == 2
    assert "trainer_graphs False against True" in capsys.readouterr().err
    a["raw"]["mps"][0]["beside_trainer_s"] = -1
    assert _from_raw(tmp_path, tmp_path / "r.json", a) == 2
    assert "lacks a positive batch, alone_s or beside_s (or beside_trainer_s)" in capsys.readouterr().err
    assert main(["calibrate-engines", "--beside", "engine,gpu", "--model", "m", "--out", str(tmp_path / "s.json")]) == 2
    assert "--beside 'engine,gpu': choose one or more of engine,trainer" in capsys.readouterr().err


def test_the_bench_runs_its_processes_under_the_stacks_fits_controls():
    from calibration.engines import stacks_controls

    # The protocol fit's runs: the trainer below normal MPS priority on 2 CPU threads, the engines on 4.
    assert stacks_controls(json.loads(open(P).read())) == {"trainer_priority": "below-normal",
                                                          "engine_cpu_threads": 4, "trainer_cpu_threads": 2}
    assert stacks_controls({"sharing": {}}) == {}
    made = []
    got = {}

    def make(*a, **k):
        got.update(k)
        return _StandIn({64: 1.1}, made)

    raw, settings = measure_engines("m", make_engines=make, log=lambda m: None, batches=[64],
                                    controls={"trainer_priority": "below-normal"}, trainer_graphs=True)
    assert got["controls"] == {"trainer_priority": "below-normal"} and got["trainer_graphs"] is True
    assert settings["controls"] == {"trainer_priority": "below-normal"} and settings["trainer_graphs"] is True


def test_a_pooled_slowdown_is_over_the_alone_times_of_the_runs_that_timed_its_kind(tmp_path):
    """A run that timed only the trainer kind (alone 2.0 s) leaves the two-engine slowdown of a run
    that timed it (alone 1.0 s, beside 1.5 s) at 1.5, not 1.5 over the pooled alone times."""
    both = {"raw": {"mps": [{"batch": 64, "adapters": 1, "alone_s": 1.0, "alone_each_s": [1.0, 1.0],
                             "beside_s": 1.5, "beside_each_s": [1.5, 1.5],
                             "beside_trainer_s": 1.2, "beside_trainer_each_s": [1.2, 1.2],
                             "train_alone_s": 0.5, "train_alone_each_s": [0.5, 0.5],
                             "train_beside_s": 0.6, "train_beside_each_s": [0.6, 0.6]}]},
            "settings": {"prompt": 128, "length": 256, "seqs_per_adapter": 64}}
    trainer_only = json.loads(json.dumps(both))
    r = trainer_only["raw"]["mps"][0]
    for k in ("beside_s", "beside_each_s"):
        del r[k]
    r.update(alone_s=2.0, alone_each_s=[2.0, 2.0, 2.0], beside_trainer_s=2.8, beside_trainer_each_s=[2.8, 2.8, 2.8])
    out = tmp_path / "p.json"
    assert _from_raw(tmp_path, out, both, trainer_only) == 0
    e = json.loads(out.read_text())["sharing"]["engines_by_batch"][0]
    assert e["mps"] == pytest.approx(1.5)  # over run 1's alone times only
    assert e["mps_beside_trainer"] == pytest.approx(2.8 / 2.0)  # both runs: medians 2.8 over 2.0


def test_the_h100_bench_profile_prices_eight_jobs_lone_trains_from_its_bench():
    """The H100 stacks profile's bench (session 60): at 256 sequences a lone trainer goes slower than
    its fitted rate, an engine beside it faster; the flag names what follows the bench (the profile
    has no two-trainer rate to keep at the fit's size)."""
    from sim.gpu import stacks_engine_rate, stacks_trainer_rate

    H100_STACKS_PROFILE = "h100-xeon16-graphed-stacks-tied-bench60-qwen3-0.6b"  # session 60's, shipped to 66
    cost = load_profile(H100_STACKS_PROFILE).profile.sharing
    assert stacks_trainer_rate("mps", cost, 256) < 0.85 * cost.mps_stacks_trainer
    assert stacks_engine_rate("mps", cost, 256) > cost.mps_stacks_engine
    s = simulate(config_from_args(jobs=8, steps=2, policy="shared-sync", sharing="mps", stacks=2,
                                  profile=H100_STACKS_PROFILE, share_prompts=4))
    flags = " ".join(s["diagnostics"][0]["outside_profile"])
    assert ("the two-engine rate and the rates of a lone trainer and an engine beside it follow the bench "
            "(sharing.stacks_engine_sequences) up to 256 > profiled 128") in flags


def test_fit_stacks_of_the_lone_trainer_on_a_base_with_the_bench_writes_its_runs_engine_size(tmp_path):
    """The fit's replays anchor the lone trainer's rate at its runs' engine size (256 sequences,
    session 39's offset 8-job runs) on a base with the bench; the written profile anchors it there too,
    not at the base's 128."""
    import glob

    runs = sorted(glob.glob("experiments/results/h200/session39/arms/*-off-mb8k-s?"))
    assert len(runs) == 4
    bench = _profile_with_bench(tmp_path, {64: 1.2, 128: 1.2, 256: 1.2, 512: 1.2},
                                by_trainer={64: 1.3, 128: 1.3, 256: 1.3, 512: 1.3}, beside=("engine", "trainer"))
    assert json.loads(bench.read_text())["sharing"]["stacks_engine_sequences"] == 128
    out = tmp_path / "fit.json"
    assert main(["fit-stacks", "--rate", "trainer", "--no-left-out", "--base", str(bench), "--out", str(out),
                 *runs]) == 0
    assert json.loads(out.read_text())["sharing"]["stacks_engine_sequences"] == 256


def test_a_bench_of_another_gpu_or_kernels_than_the_base_is_refused_by_name_unless_transplanted(tmp_path, capsys):
    """Session 61: two H100 benches (untuned LoRA kernels) went onto the H200 protocol profile without a
    word; now each difference is named, and --transplant takes it as a what-if the profile says it is."""
    h100 = {"raw": {"mps": [{"batch": 128, "adapters": 2, "alone_s": 1.0, "beside_s": 1.5}]},
            "settings": {"gpu": "NVIDIA H100 80GB HBM3", "prompt": 128, "length": 256, "seqs_per_adapter": 64,
                         "cuda_graph_max_tokens": 512, "tuned_lora_kernels": False, "beside": ["engine"],
                         "controls": {"trainer_priority": "below-normal", "engine_cpu_threads": 4,
                                      "trainer_cpu_threads": 2}}}
    assert _from_raw(tmp_path, tmp_path / "a.json", h100) == 2
    err = capsys.readouterr().err
    assert "gpu 'NVIDIA H100 80GB HBM3' against the base's 'NVIDIA H200'" in err
    assert "tuned_lora_kernels False against the base's True" in err and "--transplant" in err
    assert not (tmp_path / "a.json").exists()
    assert main(["calibrate-engines", "--from-raw", str(tmp_path / "r0.raw.json"), "--base", P,
                 "--out", str(tmp_path / "b.json"), "--transplant"]) == 0
    prof = json.loads((tmp_path / "b.json").read_text())
    assert prof["sharing"]["engines_by_batch"] == [{"batch": 128, "mps": pytest.approx(1.5)}]
    (what,) = [a for a in prof["assumptions"] if a["id"] == "sharing-engines-bench-transplanted"]
    assert "NVIDIA H100 80GB HBM3" in what["value"] and "tuned_lora_kernels" in what["value"]
    # The same bench on the base's kernels and GPU goes in without the flag or the assumption.
    h200 = json.loads(json.dumps(h100))
    h200["settings"].update(gpu="NVIDIA H200", tuned_lora_kernels=True)
    assert _from_raw(tmp_path, tmp_path / "c.json", h200) == 0
    assert "sharing-engines-bench-transplanted" not in {a["id"] for a in json.loads((tmp_path / "c.json").read_text())["assumptions"]}
    # Two GPUs' runs do not pool; a run from before the GPU was recorded pools with either.
    assert _from_raw(tmp_path, tmp_path / "d.json", h200, h100) == 2
    assert "gpu 'NVIDIA H100 80GB HBM3' against 'NVIDIA H200'" in capsys.readouterr().err
    old = json.loads(json.dumps(h200))
    del old["settings"]["gpu"]
    assert _from_raw(tmp_path, tmp_path / "e.json", old, h200) == 0


def test_a_batch_past_one_engines_kv_cache_is_refused_before_any_engine_starts(tmp_path):
    """Session 61's H100 bench: 512 sequences of 384 tokens (196,608 KV tokens an engine) at
    --engine-memory 0.38 of 79 GiB, where vLLM reported 121,744 tokens of KV cache: refused with the
    share that fits; 256 sequences (98,304) there, and 512 at 0.4 of the H200's 140 GiB, go ahead."""
    from calibration.engines import check_kv_room, kv_room_tokens
    from nodus.config import ConfigError

    qwen = tmp_path / "qwen3-0.6b"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"num_hidden_layers": 28, "num_key_value_heads": 8, "head_dim": 128,
                                                  "hidden_size": 1024, "num_attention_heads": 16,
                                                  "torch_dtype": "bfloat16"}))
    with open(qwen / "model.safetensors", "wb") as f:  # 1.38 GiB of weights, sparse
        f.truncate(int(1.38 * 2**30))
    room = kv_room_tokens(qwen, 0.38, 79.18)
    assert 115_000 < room < 125_000  # vLLM: 121,744
    with pytest.raises(ConfigError, match=r"512 sequences of 128 \+ 256 tokens need 196,608 tokens of KV cache.*"
                                          r"raise --engine-memory to 0\.5\d"):
        check_kv_room(qwen, [128, 256, 512], 128, 256, 0.38, 79.18)
    check_kv_room(qwen, [128, 256], 128, 256, 0.38, 79.18)
    check_kv_room(qwen, [128, 256, 512], 128, 256, 0.4, 139.8)
    check_kv_room(qwen, [512], 128, 256, 0.38, None)  # no GPU to ask: nothing to check
    assert kv_room_tokens(tmp_path, 0.38, 79.18) is None  # no config.json: unknown


def test_from_raw_takes_the_engine_sizes_batches_names_and_refuses_one_it_lacks(tmp_path, capsys):
    doc = {"raw": {"mps": [{"batch": b, "adapters": b // 64, "alone_s": 1.0, "beside_s": s}
                           for b, s in ((128, 1.5), (256, 1.6), (512, 1.7))]},
           "settings": {"prompt": 128, "length": 256, "seqs_per_adapter": 64, "batches": [128, 256, 512]}}
    (tmp_path / "r.raw.json").write_text(json.dumps(doc))
    args = ["calibrate-engines", "--from-raw", str(tmp_path / "r.raw.json"), "--base", P]
    assert main([*args, "--out", str(tmp_path / "a.json"), "--batches", "128,256"]) == 0
    prof = json.loads((tmp_path / "a.json").read_text())
    assert [e["batch"] for e in prof["sharing"]["engines_by_batch"]] == [128, 256]
    assert prof["measurements"]["engines"]["missing"] == []
    assert main([*args, "--out", str(tmp_path / "b.json")]) == 0  # without it, every bucket
    assert [e["batch"] for e in json.loads((tmp_path / "b.json").read_text())["sharing"]["engines_by_batch"]] == [128, 256, 512]
    assert main([*args, "--out", str(tmp_path / "c.json"), "--batches", "64,128"]) == 2
    assert "no bucket of 64 sequences (they have 128, 256, 512)" in capsys.readouterr().err
