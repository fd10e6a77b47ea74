"""calibrate-sharing's raw timings: written after every bucket, read back from that file or from a
run's log (`--from-raw`), partial runs included. No GPU, no vLLM: a timed stand-in pair."""

import json

import pytest
from factories import TimedPair

from calibration.corun import (
    bucket_line, calibrate_sharing, measure_sharing, parse_sharing_log, read_raw, write_raw,
)
from sim.profile import load_profile

GRID = {"modes": ("none", "mps"), "batches": (8, 32, 64), "train_tokens": (1000, 2000)}


def _measure(tmp_path, stop_after=None, log=None):
    """measure_sharing over GRID with timed pairs; `stop_after` buckets, then the 'time limit'."""
    counter = [0]
    return measure_sharing("no-model", modes=GRID["modes"], batches=GRID["batches"],
                           train_tokens=GRID["train_tokens"], raw_path=tmp_path / "p.raw.json",
                           log=log or (lambda m: None),
                           make_pair=lambda *a, **kw: TimedPair(*a, stop_after=stop_after, counter=counter))


def test_log_bucket_lines_round_trip_among_other_lines():
    rows = {"none": [{"batch": 64, "tokens": 16384, "engine_alone_s": 0.801, "trainer_alone_s": 0.982,
                      "engine_corun_s": 1.076, "trainer_corun_s": 3.55},
                     {"batch": 512, "tokens": 49152, "engine_alone_s": 2.129, "trainer_alone_s": 1.52,
                      "engine_corun_s": 2.853, "trainer_corun_s": 12.5}],
            "mps": [{"batch": 64, "tokens": 16384, "engine_alone_s": 0.802, "trainer_alone_s": 0.968,
                     "engine_corun_s": 0.978, "trainer_corun_s": 2.667}]}
    lines = ["INFO 11-29 23:29:36 [api_utils.py:273] non-default args: {'max_num_seqs': 512}",
             "Capturing CUDA graphs (FULL):   0%|  | 0/102\rCapturing CUDA graphs (FULL): 100%| 102/102"]
    lines += [bucket_line(m, r) for m in ("none", "mps") for r in rows[m]]
    lines.insert(3, "WARNING mps: batch 64 / x tokens: not a bucket line")
    assert parse_sharing_log("\n".join(lines) + "\n") == rows
    # The log's own format, as the H200 run printed it.
    text = ("none: batch 64 / 16384 tokens: engine 0.801 s alone, 1.076 s co-running; "
            "trainer 0.982 s alone, 3.550 s co-running")
    assert parse_sharing_log(text) == {"none": rows["none"][:1]}
    with pytest.raises(ValueError, match="appears twice"):
        parse_sharing_log(text + "\n" + text)


def test_raw_file_is_valid_after_every_bucket_and_a_stopped_run_keeps_its_buckets(tmp_path):
    raw_path = tmp_path / "p.raw.json"
    seen = []

    def log(line):  # measure_sharing logs each bucket after writing it: the file must hold it
        data = json.loads(raw_path.read_text())
        rows = [(m, r["batch"], r["tokens"]) for m, rs in data["raw"].items() for r in rs]
        seen.append(len(rows))
        assert parse_sharing_log(line) == {rows[-1][0]: [data["raw"][rows[-1][0]][-1]]}
        assert data["settings"]["modes"] == ["none", "mps"] and data["settings"]["batches"] == [8, 32, 64]
        assert not (tmp_path / "p.raw.json.tmp").exists()

    full = _measure(tmp_path, log=log)
    assert seen == list(range(1, 13))
    assert full["complete"] and "missing" not in full
    assert full["rates"]["none_corun"] == {"engine": pytest.approx(0.5), "trainer": pytest.approx(0.25)}
    assert full["rates"]["mps_corun"] == {"engine": pytest.approx(0.8), "trainer": pytest.approx(0.5)}

    raw_path.unlink()
    with pytest.raises(RuntimeError, match="time limit"):
        _measure(tmp_path, stop_after=10)  # all 6 `none` buckets, 4 of 6 `mps`: the H200 run's stop
    raw, settings = read_raw(raw_path, GRID)
    assert [len(raw["none"]), len(raw["mps"])] == [6, 4]
    assert raw["mps"][-1] == full["raw"]["mps"][3]


def test_partial_raw_gives_a_profile_with_per_batch_rates_and_its_gaps_on_record(tmp_path):
    with pytest.raises(RuntimeError):
        _measure(tmp_path, stop_after=10)
    out = tmp_path / "p.json"
    prof = calibrate_sharing(None, "h200-qwen3-0.6b", out, from_raw=tmp_path / "p.raw.json")
    m = prof["measurements"]["sharing"]
    assert m["complete"] is False
    assert m["missing"] == [{"mode": "mps", "batch": 64, "tokens": 1000}, {"mode": "mps", "batch": 64, "tokens": 2000}]
    assert m["from_raw"] == {"file": str(tmp_path / "p.raw.json"), "format": "raw json"}
    assert m["rates_measured"] == ["none_corun", "mps_alone", "mps_corun"]
    by = prof["sharing"]["corun_by_engine_batch"]
    assert [e["batch"] for e in by] == [8, 32, 64]
    assert by[1]["mps_corun"] == {"engine": pytest.approx(0.8), "trainer": pytest.approx(0.5)}
    assert "mps_corun" not in by[2] and by[2]["none_corun"]["trainer"] == pytest.approx(0.25)
    gap = next(a for a in prof["assumptions"] if a["id"] == "sharing-buckets-missing")
    assert "mps: batch 64 / 1000 tokens, batch 64 / 2000 tokens" in gap["what"]
    assert not any(a["id"] == "sharing-from-base" for a in prof["assumptions"])
    assert "validation" not in prof  # the base's error bar does not describe these rates
    assert prof["environment"]["sources"][-1] == "nodus calibrate-sharing --from-raw p.raw.json (none,mps)"
    load_profile(str(out))  # the simulator reads it
    with pytest.raises(FileExistsError):
        calibrate_sharing(None, "h200-qwen3-0.6b", out, from_raw=tmp_path / "p.raw.json")


def test_read_raw_errors_name_the_file_and_the_problem(tmp_path):
    bad = {"x.json": ("{\"raw\": {", "not valid JSON"),
           "nosettings.json": ('{"raw": {"none": []}}', "'settings'"),
           "empty.log": ("INFO nothing here\n", "no bucket lines"),
           "mps.log": (bucket_line("mps", {"batch": 8, "tokens": 1000, "engine_alone_s": 1, "engine_corun_s": 1,
                                           "trainer_alone_s": 1, "trainer_corun_s": 1}), "no bucket of mode 'none'"),
           "off-grid.log": (bucket_line("none", {"batch": 9, "tokens": 1000, "engine_alone_s": 1, "engine_corun_s": 1,
                                                 "trainer_alone_s": 1, "trainer_corun_s": 1}), "outside --modes"),
           "zero.json": (json.dumps({"raw": {"none": [{"batch": 8, "tokens": 1000, "engine_alone_s": 0,
                                                       "engine_corun_s": 1, "trainer_alone_s": 1,
                                                       "trainer_corun_s": 1}]},
                                     "settings": {"batches": [8], "train_tokens": [1000]}}), "positive")}
    for name, (text, problem) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=problem) as err:
            read_raw(tmp_path / name, GRID)
        assert name in str(err.value)
    with pytest.raises(FileNotFoundError, match="absent.json"):
        read_raw(tmp_path / "absent.json", GRID)
    write_raw(tmp_path / "sub" / "ok.json", {"none": []}, {"batches": [8], "train_tokens": [1000]})
    with pytest.raises(ValueError, match="no bucket of mode 'none'"):
        read_raw(tmp_path / "sub" / "ok.json", GRID)


def test_sharing_is_measured_beside_the_engine_kernels_the_base_describes(tmp_path):
    """calibrate-sharing runs its engine with the LoRA kernels its base profile's engine terms
    describe (environment.lora_kernel_configs), as it runs the base's trainer."""
    from sim.profile import profile_dict

    asked = []

    class Stop(Exception):
        pass

    def pair(*a, **kw):
        asked.append(kw)
        raise Stop

    base = profile_dict("h200-xeon16-qwen3-0.6b")
    tuned = dict(base, environment=dict(base["environment"], lora_kernel_configs={"source": "shipped"}))
    (tmp_path / "tuned.json").write_text(json.dumps(tuned))
    for name, want in (("h200-xeon16-qwen3-0.6b", False), (str(tmp_path / "tuned.json"), True)):
        with pytest.raises(Stop):
            calibrate_sharing("no-model", base=name, out=tmp_path / f"out{want}.json", make_pair=pair)
        assert asked[-1] == {"trainer_graphs": False, "tuned_lora_kernels": want}


def test_calibrate_sharing_refuses_a_base_measured_with_a_capped_trainer(tmp_path):
    """The co-run bench measures the trainer on torch's own CPU thread count, as nodus calibrate
    does: a base whose train terms came from capped trainers (environment.trainer_cpu_threads) is
    refused before anything is measured."""
    from sim.profile import profile_dict

    base = profile_dict("h200-qwen3-0.6b")
    base["environment"]["trainer_cpu_threads"] = 2
    (tmp_path / "capped.json").write_text(json.dumps(base))
    with pytest.raises(ValueError, match="measured with the trainer on 2 CPU threads"):
        calibrate_sharing("/nonexistent-model", str(tmp_path / "capped.json"), tmp_path / "out.json",
                          log=lambda *_: None)
    assert not (tmp_path / "out.json").exists()


class _DriftingPair(TimedPair):
    """Every timing of a bucket 3% faster than the one before (from 1.2x), as the H100's engines'
    alone times fell through a bucket (session 61); records the order of timed kinds."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.order, self.k = [], 0

    def alone(self, side, work, repeats):
        self.order.append(("alone", side))
        self.k += 1
        return super().alone(side, work, repeats) * (1.2 - 0.03 * (self.k - 1))

    def corun(self, fg, fg_work, bg_work, repeats):
        self.order.append(("corun", fg))
        self.k += 1
        return super().corun(fg, fg_work, bg_work, repeats) * (1.2 - 0.03 * (self.k - 1))


def test_a_buckets_alone_and_corun_timings_are_interleaved_so_a_drift_falls_on_both():
    """Kind by kind (repeats alone, then repeats co-run) this drift would put the engine's 2x
    time-sliced slowdown well under 2x; one of each kind a round, every other round reversed (ABBA),
    keeps it within 1%."""
    made = []

    def pair(*a, **kw):
        made.append(_DriftingPair(*a))
        return made[-1]

    rates = measure_sharing("no-model", modes=("none", "mps"), batches=(64,), train_tokens=(1000,), repeats=4,
                            make_pair=pair, log=lambda m: None)
    timed = made[0].order[2:]  # after the warm-up of each shape
    assert timed[:4] == [("corun", "engine"), ("alone", "engine"), ("alone", "trainer"), ("corun", "trainer")]
    assert timed[4:8] == timed[:4][::-1] and len(timed) == 16
    row = rates["raw"]["none"][0]
    assert row["engine_corun_s"] / row["engine_alone_s"] == pytest.approx(TimedPair.SLOW["none"]["engine"], rel=0.01)
    assert row["trainer_corun_s"] / row["trainer_alone_s"] == pytest.approx(TimedPair.SLOW["none"]["trainer"], rel=0.01)
