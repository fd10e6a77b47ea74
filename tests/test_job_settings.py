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
