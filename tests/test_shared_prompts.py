"""The trainer's shared-prompt layout (``share_prompts``: a prompt group's sequences packed into
one row, the prompt computed once) against plain rows, on a tiny random Qwen3 on the CPU in fp64:
the same losses, grad norms, updates and audit, for every loss type, on- and off-policy rows, KL
terms, groups split over several rows and micro-batches."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from real.graphed import packed_length, packed_row, prompt_groups, shared_prompt_mask  # noqa: E402
from real.trainer import JobBatch  # noqa: E402
# one_thread: the tiny model on one OpenMP thread (autouse, as in test_trainer).
from tests.test_trainer import VOCAB, make_trainer, one_thread, params, with_old_logprobs  # noqa: E402, F401
from tests.test_trainer_static import KL_JOBS  # noqa: E402


def update_rel_diff(got, want, init) -> float:
    """||(got - init) - (want - init)|| / ||want - init|| over the job's whole parameter vector."""
    d = torch.cat([(got[k] - want[k]).flatten() for k in want])
    u = torch.cat([(want[k] - init[k]).flatten() for k in want])
    return float(d.norm() / u.norm())


def grouped_batch(prompts, per_prompt, seed, holes=False):
    """GRPO's shape: ``per_prompt`` responses to each of ``prompts`` prompts (prompt lengths and
    response lengths vary), the responses of a prompt consecutive; ``holes``: some completion
    tokens not trained on (a mask with gaps)."""
    rng = np.random.default_rng(seed)
    ids, mask = [], []
    for _ in range(prompts):
        prompt = rng.integers(0, VOCAB, int(rng.integers(2, 7))).tolist()
        for _ in range(per_prompt):
            n = int(rng.integers(1, 12))
            ids.append(prompt + rng.integers(0, VOCAB, n).tolist())
            m = [1] * n
            if holes and n > 3:
                m[1] = 0
            mask.append([0] * len(prompt) + m)
    return JobBatch(ids, mask, rng.normal(size=len(ids)).tolist())


def step_data():
    reference = make_trainer({})
    one = {"a": grouped_batch(3, 4, seed=1), "b": grouped_batch(2, 5, seed=2, holes=True),
           "c": grouped_batch(4, 2, seed=3), "d": grouped_batch(2, 3, seed=4)}
    two = {j: with_old_logprobs(grouped_batch(3, 3, seed=10 + i), reference, seed=i)
           for i, j in enumerate(("a", "b", "c", "d"))}
    return one, two


@pytest.mark.parametrize("share", [8, 2])
@pytest.mark.parametrize("mb_tokens", [4096, 40])
def test_shared_prompts_give_the_plain_update(share, mb_tokens):
    """To 1e-6: Qwen3's RMSNorm computes in fp32 even in an fp64 model, so a prompt's gradient summed
    over its responses before that rounding (packed) and after it (plain rows) differ at fp32's
    ~1e-8, and the second step starts from updates that differ that much; a completion that saw
    another's tokens moves the grad norm by ~1e-3 here. The forward's logprobs agree to fp64
    rounding (the audit test)."""
    one, two = step_data()
    trainers = {s: make_trainer(KL_JOBS, dtype=torch.float64, max_tokens_per_microbatch=mb_tokens,
                                step_mode="static", share_prompts=s) for s in (0, share)}
    init = {j: params(trainers[0], j) for j in KL_JOBS}
    stats = {s: [t.train_step(one), t.train_step(two)] for s, t in trainers.items()}
    for got, want in zip(stats[share], stats[0]):
        for j in KL_JOBS:
            assert got[j].loss == pytest.approx(want[j].loss, rel=1e-6, abs=1e-12)
            assert got[j].grad_norm == pytest.approx(want[j].grad_norm, rel=1e-6)
            assert got[j].tokens == want[j].tokens  # the job's own count, not the packed rows'
    for j in KL_JOBS:
        # AdamW's first steps scale each entry by its own gradient's size: the updates agree to
        # ~1e-6 of their norm (a completion seeing another's tokens: 0.7-1.1 of it).
        assert update_rel_diff(params(trainers[share], j), params(trainers[0], j), init[j]) < 1e-4
    assert all(k.shared for k in trainers[share].programs) and not any(k.shared for k in trainers[0].programs)
    if mb_tokens == 40:
        assert trainers[share].last_microbatches > 1


def test_shared_prompts_audit_matches_plain_rows():
    batches = {"a": grouped_batch(3, 4, seed=1), "b": grouped_batch(2, 5, seed=2, holes=True)}
    jobs = {j: KL_JOBS[j] for j in batches}
    base = make_trainer({}, dtype=torch.float64)
    mine = {j: [t.numpy() + 0.25 * (i % 2) for i, t in enumerate(base.logprobs(None, b))] for j, b in batches.items()}
    mine["b"][3] = None  # a sequence left out of the audit
    audits = {}
    for s in (0, 4):
        t = make_trainer(jobs, dtype=torch.float64, step_mode="static", share_prompts=s, max_tokens_per_microbatch=64)
        # the base's logprobs are the step's: every adapter starts at B = 0
        t.train_step(batches, audit=mine)
        audits[s] = t.last_audit
    for j in batches:
        for k in ("max_abs", "mean_abs"):
            assert audits[4][j][k] == pytest.approx(audits[0][j][k], rel=1e-9, abs=1e-12)
    assert audits[4]["a"]["max_abs"] == pytest.approx(0.25, abs=1e-9)


def test_prompt_groups_and_packed_rows():
    ids = [np.array(x) for x in ([1, 2, 7, 8], [1, 2, 9], [3, 4], [1, 2, 5, 6, 4], [1, 2, 7])]
    pos = [np.array(x) for x in ([2, 3], [2], [], [2, 4], [2])]  # the 4th has a hole at index 3
    assert prompt_groups(ids, pos, 8) == [[0, 1, 3, 4], [2]]
    assert prompt_groups(ids, pos, 2) == [[0, 1], [2], [3, 4]]  # chunks in order of appearance
    assert packed_length(ids, pos, [0, 1, 3, 4]) == 2 + 2 + 1 + 3 + 1
    toks, p, seg, predict = packed_row(ids, pos, [0, 1, 3])
    assert toks.tolist() == [1, 2, 7, 8, 9, 5, 6, 4]
    assert p.tolist() == [0, 1, 2, 3, 2, 2, 3, 4]  # each part keeps its positions alone
    assert seg.tolist() == [0, 0, 1, 1, 2, 3, 3, 3]
    # the first completion token of every sequence is predicted from the shared prompt's last token
    assert [q.tolist() for q in predict] == [[1, 2], [1], [1, 6]]


def test_shared_prompt_mask_keeps_each_sequence_to_its_prompt_and_itself():
    seg = torch.tensor([[0, 0, 1, 1, 2, -1]])
    m = shared_prompt_mask(seg)[0, 0]
    assert m[3].tolist() == [True, True, True, True, False, False]  # second token of part 1
    assert m[4].tolist() == [True, True, False, False, True, False]  # part 2 skips part 1
    assert m[1].tolist() == [True, True, False, False, False, False]  # the prompt stays causal
    assert m[5].tolist() == [False] * 5 + [True]  # padding: itself only


def test_a_decoder_that_lets_responses_see_each_other_is_refused(monkeypatch):
    """The trainer checks, on the model itself, that a packed row's mask is honoured (a transformers
    whose decoder ignored it would train every response on the others' tokens)."""
    import real.graphed

    def leaky(seg):
        T = seg.shape[1]
        idx = torch.arange(T)
        return (idx[None, :] <= idx[:, None])[None, None].expand(seg.shape[0], 1, T, T)

    monkeypatch.setattr(real.graphed, "shared_prompt_mask", leaky)
    with pytest.raises(ValueError, match="does not honour the packed row's attention mask"):
        make_trainer({}, step_mode="static", share_prompts=4)


def test_share_prompts_is_checked():
    with pytest.raises(ValueError, match="share_prompts"):
        make_trainer({}, step_mode="static", share_prompts=-1)
    for other in ({"step_mode": "eager"}, {"step_mode": "static", "lora_layout": "padded"},
                  {"step_mode": "static", "gradient_checkpointing": True}):
        with pytest.raises(ValueError, match="share_prompts=4 packs .* the fixed-shape step"):
            make_trainer({}, share_prompts=4, **other)
    t = make_trainer({}, step_mode="static", share_prompts=4)
    with pytest.raises(ValueError, match="packed_width"):
        t.prepare_static(2, 4, 32)
    keys = t.prepare_static(2, 4, 32, packed_width=96)
    assert keys and all(k.shared and k.width <= 96 for k in keys)


def test_bench_shared_prompts_on_the_cpu(tmp_path):
    """experiments/bench_shared_prompts.py --tiny: every variant timed on the same rows, the model's
    tokens cut by the sharing, the shared updates where the plain ones land (fp32)."""
    import json

    from experiments.bench_shared_prompts import main

    out = tmp_path / "shared.json"
    report = main(["--tiny", "--jobs", "2", "--share", "0,4", "--iters", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    (case,) = report["cases"]
    plain, shared = case["variants"]["0"], case["variants"]["4"]
    assert shared["model_tokens"] < plain["model_tokens"] and plain["speedup"] == 1.0
    assert len(shared["step_s"]) == 1 and shared["graph_error"] is None
    assert case["update_rel_diff"]["4"] < 1e-4


def test_bench_shared_prompts_checks_its_arguments(tmp_path, capsys):
    from experiments.bench_shared_prompts import main

    for bad in (["--share", "4,8"], ["--share", "0,x"], ["--jobs", "0"]):
        with pytest.raises(SystemExit):
            main(["--tiny", "--out", str(tmp_path / "x.json"), *bad])
    assert "--share" in capsys.readouterr().err
