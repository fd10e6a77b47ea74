"""calibrate-sharing's rates from timings (no GPU, no vLLM): a disturbed bucket is left out, not
written into a profile the simulator would refuse."""

import json

import pytest


def test_a_bucket_faster_beside_the_engine_than_alone_is_left_out_and_named(tmp_path):
    """The fresh clone's run on a busy 2-core host timed a trainer 2.81 s alone and 0.46 s beside
    the engine (rate 6.1, past the profile's bound of 2): the command failed on the profile's
    schema. The bucket is now left out of that rate, named, and the profile loads."""
    from calibration.corun import apply_sharing, sharing_rates
    from sim.profile import load_profile

    none = [{"batch": 8, "tokens": 512, "engine_alone_s": 1.897, "engine_corun_s": 10.695,
             "trainer_alone_s": 2.567, "trainer_corun_s": 6.474},
            {"batch": 8, "tokens": 1024, "engine_alone_s": 5.485, "engine_corun_s": 6.123,
             "trainer_alone_s": 2.807, "trainer_corun_s": 0.457}]
    rates = sharing_rates({"none": none})
    assert rates["none_corun"]["trainer"] == pytest.approx(2.567 / 6.474)  # the plausible bucket alone
    assert rates["none_corun_range"]["trainer"] == [pytest.approx(2.567 / 6.474)] * 2
    assert rates["none_corun"]["engine"] == pytest.approx((1.897 / 10.695 + 5.485 / 6.123) / 2)  # both kept
    assert rates["implausible"] == [{"batch": 8, "tokens": 1024, "rate": "none_corun", "side": "trainer",
                                     "value": pytest.approx(2.807 / 0.457)}]
    prof = json.loads(load_profile("h200-qwen3-0.6b").profile.model_dump_json(by_alias=True))
    full = apply_sharing(prof, {"rates": rates})
    assert full["sharing"]["corun_by_engine_batch"][0]["none_corun"]["trainer"] == pytest.approx(2.567 / 6.474)
    (tmp_path / "p.json").write_text(json.dumps(full))
    load_profile(str(tmp_path / "p.json"))  # the simulator reads it
    # Every bucket of a rate disturbed: a clear error, not a profile.
    with pytest.raises(ValueError, match="none_corun.trainer: every bucket measured it above 2.0"):
        sharing_rates({"none": [none[1]]})
