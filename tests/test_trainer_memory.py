"""experiments/trainer_memory.py: each micro-batch size measured in a process of its own, through the
real backend's warm-up (real.workers.warm_trainer), on a tiny CPU model here."""

import json

import pytest

from experiments import trainer_memory


def test_each_size_runs_the_warm_up_in_its_own_process_and_is_recorded(tmp_path):
    out = tmp_path / "tm.json"
    trainer_memory.main(["--tiny", "--device", "cpu", "--mode", "static", "--mb-tokens", "512,1024", "--rows", "4",
                         "--jobs", "2", "--prompt-tokens", "20", "--new-tokens", "30", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["mb_tokens"] for r in rows] == [512, 1024]
    for r in rows:
        # the static program built (the fixed shapes a graphed trainer captures), no memory off a GPU
        assert r["step_mode"] == "static" and r["graphs"] > 0 and r["graph_error"] is None and r["memory"] is None
        assert r["estimate_gib"] == 50.0  # not graphed: the eager estimate


def test_a_size_that_fails_is_recorded_with_its_error_and_the_rest_run(tmp_path):
    out = tmp_path / "tm.json"
    trainer_memory.main(["--tiny", "--device", "nodevice", "--mode", "static", "--mb-tokens", "512",
                         "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["mb_tokens"] == 512 and "nodevice" in row["error"]


@pytest.mark.parametrize("argv, what", [(["--mb-tokens", "8k"], "integers"), (["--mb-tokens", "128"], "at least 256"),
                                        (["--jobs", "0"], "--jobs 0: at least 1")])
def test_bad_arguments_are_named(tmp_path, capsys, argv, what):
    with pytest.raises(SystemExit):
        trainer_memory.parse_args([*argv, "--out", str(tmp_path / "x.json")])
    assert what in capsys.readouterr().err
