"""A job's own problems (jobs[].dataset): read, split, sampled and scored as the built-in families are."""

import json
import os

import pytest

from nodus.config import DatasetSpec, JobSpec, build_config
from nodus.tasks import get_task
from nodus.tasks.base import solution_text
from nodus.tasks.datasets import check_datasets, dataset_split, load_items_jsonl


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _mod_rows(n, start=0):
    return [{"question": f"What is ({a} + 5) mod 7?", "answer": (a + 5) % 7} for a in range(start, start + n)]


def test_answers_bare_or_worked_and_questions_under_either_key(tmp_path):
    f = _write(tmp_path / "d.jsonl", [
        {"question": " What is 2 + 3? ", "answer": "5"},
        {"prompt": "Sum of 1,000 and 1?", "answer": "1000 + 1 = 1001\n#### 1,001"},
        {"question": "Half of 3?", "answer": 1.5},
        "",
        {"question": "Solve x + y = 3, x - y = 1.", "answer": "x = 2, y = 1 #### 2 1"},
    ])
    items = load_items_jsonl(f, "gsm8k")
    assert [(it.prompt, it.answer, it.work) for it in items] == [
        ("What is 2 + 3?", "5", ""), ("Sum of 1,000 and 1?", "1,001", "1000 + 1 = 1001"),
        ("Half of 3?", "1.5", ""), ("Solve x + y = 3, x - y = 1.", "2 1", "x = 2, y = 1")]
    check = get_task("gsm8k")
    assert all(check.reward(it, solution_text(it)) == 1.0 for it in items)  # a correct completion scores
    assert check.reward(items[1], "so #### 1001") == 1.0 and check.reward(items[0], "#### 6") == 0.0


@pytest.mark.parametrize("line,why", [
    ("{not json", "d.jsonl:2: not valid JSON"),
    ('["a", "b"]', "d.jsonl:2: expected a JSON object"),
    ('{"answer": "1"}', "d.jsonl:2: missing or empty 'question'"),
    ('{"question": "q", "answer": true}', "d.jsonl:2: 'answer' must be a string or a number, got bool"),
    ('{"question": "q", "answer": ["1"]}', "d.jsonl:2: 'answer' must be a string or a number, got list"),
    ('{"question": "q", "answer": "steps ####  "}', "d.jsonl:2: empty final answer"),
])
def test_a_bad_line_is_an_error_naming_the_file_and_line(tmp_path, line, why):
    f = _write(tmp_path / "d.jsonl", [{"question": "ok?", "answer": 1}, line])
    with pytest.raises(ValueError, match=why.replace("(", "\\(")):
        load_items_jsonl(f, "gsm8k")


def test_missing_and_empty_files_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset file not found: .*nope.jsonl"):
        load_items_jsonl(tmp_path / "nope.jsonl", "gsm8k")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="e.jsonl: no records"):
        load_items_jsonl(tmp_path / "e.jsonl", "gsm8k")


def test_the_eval_set_is_held_out_and_never_trained_on(tmp_path):
    f = _write(tmp_path / "d.jsonl", _mod_rows(30) + _mod_rows(2))  # the last two repeat the first two
    train, held = dataset_split(DatasetSpec(train=str(f), eval_size=5), "modular")
    assert [it.prompt for it in held] == [r["question"] for r in (_mod_rows(30) + _mod_rows(2))[-5:]]
    assert not {it.prompt for it in train} & {it.prompt for it in held}  # repeats of eval questions dropped
    assert len(train) == 25
    e = _write(tmp_path / "e.jsonl", _mod_rows(3, start=100))
    train2, held2 = dataset_split(DatasetSpec(train=str(f), eval=str(e)), "modular")
    assert len(held2) == 3 and len(train2) == 32  # with an eval file, every training item trains
    with pytest.raises(ValueError, match="32 items; holding out the last eval_size=64"):
        dataset_split(DatasetSpec(train=str(f)), "modular")
    same = _write(tmp_path / "s.jsonl", _mod_rows(3, start=100))
    with pytest.raises(ValueError, match="every training question is also an eval question"):
        dataset_split(DatasetSpec(train=str(same), eval=str(e)), "modular")


def test_a_changed_file_is_read_again(tmp_path):
    f = _write(tmp_path / "d.jsonl", _mod_rows(10))
    spec = DatasetSpec(train=str(f), eval_size=2)
    assert len(dataset_split(spec, "modular")[0]) == 8
    _write(f, _mod_rows(20))
    os.utime(f, (1e9, 1e9))  # a new stamp even within the file system's time resolution
    assert len(dataset_split(spec, "modular")[0]) == 18


def test_dataset_configs_are_checked(tmp_path):
    f = _write(tmp_path / "d.jsonl", _mod_rows(10))
    ok = build_config({"jobs": [{"task": "modular", "dataset": {"train": str(f), "eval_size": 2}}],
                       "arm": {"policy": "shared-sync", "groups": 1}})
    assert ok.jobs[0].dataset.train == str(f)
    with pytest.raises(ValueError, match="dataset with task='countdown'"):
        JobSpec(task="countdown", dataset={"train": str(f)})
    with pytest.raises(ValueError, match="dataset with prompt_pool"):
        JobSpec(task="modular", prompt_pool=4, dataset={"train": str(f)})
    with pytest.raises(ValueError, match="split"):
        JobSpec(task="modular", dataset={"train": str(f), "split": 0.1})
    with pytest.raises(FileNotFoundError, match="job j7: dataset file not found"):
        check_datasets([JobSpec(id="j7", task="modular", dataset={"train": str(tmp_path / "gone.jsonl")})])


def test_each_step_samples_its_prompts_from_the_training_split_and_scores_them_by_the_check(tmp_path):
    pytest.importorskip("numpy")
    from real.rollouts import rewards, step_prompts

    f = _write(tmp_path / "d.jsonl", _mod_rows(12))
    job = JobSpec(id="j", task="modular", seed=3, prompts_per_step=4, responses_per_prompt=2,
                  dataset={"train": str(f), "eval_size": 4})
    train, held = dataset_split(job.dataset, "modular")
    a, b, again = (step_prompts(job, k, "tasks", 100) for k in (0, 1, 0))
    assert a.prompts == again.prompts and a.prompts != b.prompts  # seeded per (job, step)
    assert {p.strip() for p in a.prompts + b.prompts} <= {it.prompt for it in train}
    assert len(set(a.prompts)) == 4  # a step's prompts are distinct when the set is large enough
    texts = [[f"#### {it.answer}", "#### 99"] for it in a.items]
    assert rewards(job, 0, a, texts, 2) == [1.0, 0.0] * 4
    small = job.model_copy(update={"prompts_per_step": 20})  # more prompts than items: the set repeats
    assert len(step_prompts(small, 0, "tasks", 100).prompts) == 20


def test_nodus_tasks_dataset_reads_it_as_a_run_would(tmp_path, capsys):
    from nodus.cli import main

    f = _write(tmp_path / "d.jsonl", _mod_rows(10))
    assert main(["tasks", "dataset", str(f), "--task", "modular", "--eval-size", "3", "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "7 training items, 3 eval items (the last 3 of the training file), scored by modular's check" in out
    assert "(reward 1.0)" in out
    assert main(["tasks", "dataset", str(tmp_path / "gone.jsonl")]) == 2
    assert "dataset file not found" in capsys.readouterr().err


def test_a_real_run_with_a_missing_dataset_stops_before_any_process(tmp_path, capsys):
    pytest.importorskip("torch")
    from nodus.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"jobs:\n  - {{id: acme, task: modular, dataset: {{train: {tmp_path}/gone.jsonl}}}}\n"
                   "arm: {policy: shared-sync, groups: 1, sharing: none}\n")
    assert main(["run", str(cfg), "--backend", "real", "--model", "tiny", "--no-baseline",
                 "--out", str(tmp_path / "out")]) == 2
    assert "job acme: dataset file not found" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
