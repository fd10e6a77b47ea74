"""A job's own GRPO update settings (jobs[].loss_type, epsilon, beta, ...): checked and resolved."""

import pytest

from nodus.config import JobSpec, TrainerSpec, build_config, grpo_settings


def test_unset_settings_resolve_to_the_defaults_and_set_ones_are_the_jobs():
    plain = grpo_settings(JobSpec(task="gsm8k", lora_rank=8), TrainerSpec(max_grad_norm=0.5))
    assert plain == {"alpha": 16.0, "loss_type": "grpo", "epsilon_low": 0.2, "epsilon_high": 0.2, "beta": 0.0,
                     "weight_decay": 0.0, "max_grad_norm": 0.5, "max_completion_length": None}
    own = grpo_settings(JobSpec(task="gsm8k", loss_type="dr_grpo", epsilon=0.1, beta=0.04, max_grad_norm=2.0,
                                weight_decay=0.01, lora_alpha=4, max_new_tokens=300), TrainerSpec())
    assert own == {"alpha": 4.0, "loss_type": "dr_grpo", "epsilon_low": 0.1, "epsilon_high": 0.1, "beta": 0.04,
                   "weight_decay": 0.01, "max_grad_norm": 2.0, "max_completion_length": 300}
    assert grpo_settings(JobSpec(task="gsm8k", epsilon=0.2, epsilon_high=0.28), TrainerSpec())["epsilon_high"] == 0.28


@pytest.mark.parametrize("field,value", [("loss_type", "ppo"), ("epsilon", 1.0), ("epsilon", 0), ("beta", -0.1),
                                         ("beta", float("inf")), ("max_grad_norm", 0), ("weight_decay", -1),
                                         ("lora_alpha", 0)])
def test_bad_settings_are_errors_naming_the_field(field, value):
    with pytest.raises(ValueError) as err:
        build_config({"jobs": [{"task": "gsm8k", field: value}], "arm": {"policy": "shared-sync", "groups": 1}})
    assert f"jobs.0.{field}" in str(err.value)


def test_unset_settings_keep_a_config_dump_as_before():
    """Recorded configs and run keys read the dump: a job that sets none of them dumps none."""
    assert not {"loss_type", "epsilon", "beta", "lora_alpha"} & set(JobSpec(task="gsm8k").model_dump(exclude_none=True))


def test_the_kl_term_is_priced_where_the_profile_measured_it_and_flagged_where_not(tmp_path):
    """jobs[].beta > 0 adds the base model's forward pass over the job's tokens: priced as
    train.kl_share of the micro-batches' cost, for the step's share of tokens that are those jobs'
    (a what-if of the train terms moves it too); flagged and unpriced in a profile without it."""
    import json

    from nodus.simulate import config_from_args, simulate
    from sim.profile import load_profile, profile_dict, what_if

    prof = profile_dict("h200-qwen3-0.6b")  # its micro-batch cost is a constant (b_s_per_unit 0)
    prof["train"]["kl_share"] = 0.5
    path = tmp_path / "kl.json"
    path.write_text(json.dumps(prof))
    cost = load_profile(str(path))
    mb = prof["train"]["per_microbatch"]
    base = cost.train_s([8000, 4000], adapters=2)
    assert cost.train_s([8000, 4000], adapters=2, kl_fraction=0.25) == pytest.approx(
        base + 0.5 * 0.25 * (2 * mb["a_s"] + mb["b_s_per_unit"] * 12000))
    half = tmp_path / "half.json"
    half.write_text(json.dumps(what_if(prof, {"train": 0.5})))
    assert load_profile(str(half)).train_s([8000], 2, kl_fraction=0.25) == pytest.approx(
        0.5 * cost.train_s([8000], 2, kl_fraction=0.25))

    def run(profile, beta):
        data = {"jobs": [{"task": "gsm8k", **({"beta": beta} if beta else {})}, {"task": "sorting"}],
                "arm": {"policy": "shared-sync", "groups": 1}}
        return simulate(config_from_args(data, steps=3, profile=profile))

    priced, plain = run(str(path), 0.04), run(str(path), None)
    assert priced["gpu_seconds"] > plain["gpu_seconds"] and not any("beta" in f for f in priced["outside_profile"])
    unpriced = run("h200-qwen3-0.6b", 0.04)
    assert unpriced["gpu_seconds"] == pytest.approx(run("h200-qwen3-0.6b", None)["gpu_seconds"])
    assert any("jobs[].beta > 0 (job0)" in f for f in unpriced["outside_profile"])
