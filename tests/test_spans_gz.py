"""A recorded run whose spans.jsonl is kept as spans.jsonl.gz (old sessions' runs, to keep the tree a
GPU call carries small) reads as before everywhere: the timeline, validation, replayed lengths, the
run identity a fit records, stack alignment and `nodus report`."""

import gzip
import shutil

import pytest

from calibration.validate import load_recorded, spans_digest, validate
from experiments import stack_alignment as sa
from nodus.config import ConfigError
from nodus.simulate import config_from_args, report, simulate
from nodus.timeline import read_jsonl, read_text, stored


def _gzipped_copy(run, to):
    shutil.copytree(run, to)
    plain = to / "spans.jsonl"
    (to / "spans.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
    plain.unlink()
    return to


def test_a_gzipped_run_reads_as_the_plain_one(tmp_path):
    run = tmp_path / "runs" / "plain"
    simulate(config_from_args(jobs=4, steps=3, policy="shared-sync", sharing="mps", seed=1, stacks=2), out=run)
    gz = _gzipped_copy(run, tmp_path / "runs" / "gz")
    assert stored(gz / "spans.jsonl") == gz / "spans.jsonl.gz" and stored(run / "spans.jsonl") == run / "spans.jsonl"
    assert read_text(gz / "spans.jsonl") == (run / "spans.jsonl").read_text()
    assert [[s.to_dict() for s in r] for r in read_jsonl(gz / "spans.jsonl")] == \
        [[s.to_dict() for s in r] for r in read_jsonl(run / "spans.jsonl")]
    assert load_recorded(gz) == load_recorded(run)
    assert spans_digest(gz) == spans_digest(run)  # a fit's record of its runs still matches
    a, b = sa.run_alignment(gz), sa.run_alignment(run)
    assert {k: v for k, v in a.items() if k != "run"} == {k: v for k, v in b.items() if k != "run"}
    # Validation replays the recorded lengths from the compressed file: the same predictions.
    pa, pb = (validate([str(d)], "h200-qwen3-0.6b")["rows"][0] for d in (gz, run))
    assert pa["replay"] == pb["replay"] and pa["replay"]["steps_per_gpu_hour"] > 0
    assert report(gz).startswith("|")


def test_a_run_without_spans_is_still_refused_by_name(tmp_path):
    run = tmp_path / "plain"
    simulate(config_from_args(jobs=2, steps=2, policy="shared-sync", sharing="none", seed=1), out=run)
    (run / "spans.jsonl").unlink()
    with pytest.raises(ConfigError, match="spans.jsonl is missing"):
        load_recorded(run)
