import pytest

from megatron_abft.config import POLICIES, SECTIONS, ABFTConfig


def test_defaults_check_every_section_every_step():
    cfg = ABFTConfig()
    assert cfg.sections == SECTIONS
    assert all(cfg.checks(s, step) for s in SECTIONS for step in range(3))


def test_sections_accept_a_comma_string_and_keep_the_canonical_order():
    assert ABFTConfig(sections="proj, qkv").sections == ("qkv", "proj")
    assert not ABFTConfig(sections="qkv").checks("scores", 0)


def test_intervals_per_section():
    cfg = ABFTConfig(check_interval={"scores": 4})
    assert cfg.interval("scores") == 4 and cfg.interval("qkv") == 1
    assert [cfg.checks("scores", s) for s in range(5)] == [True, False, False, False, True]
    assert ABFTConfig(check_interval=3).interval("proj") == 3


def test_disabled_checks_nothing():
    cfg = ABFTConfig(enabled=False)
    assert not any(cfg.checks(s, 0) for s in SECTIONS)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"sections": ["qk"]},
            "ABFTConfig.sections: unknown section 'qk'; choose from qkv, scores",
        ),
        ({"sections": ["qkv", "qkv"]}, "ABFTConfig.sections"),
        ({"check_interval": 0}, "ABFTConfig.check_interval: 0 is not allowed"),
        ({"check_interval": {"softmax": 2}}, "unknown section 'softmax'"),
        ({"check_interval": {"qkv": 1.5}}, "check_interval['qkv']"),
        ({"block_size": 1}, "ABFTConfig.block_size: 1"),
        ({"threshold_scale": float("nan")}, "ABFTConfig.threshold_scale"),
        ({"near_inf": -1.0}, "ABFTConfig.near_inf"),
        ({"on_uncorrectable": "ignore"}, f"choose from {', '.join(POLICIES)}"),
        ({"enabled": "yes"}, "ABFTConfig.enabled"),
        ({"sync_free": 1}, "ABFTConfig.sync_free: 1 is not allowed; use True, False or None"),
    ],
)
def test_bad_values_name_the_field_the_value_and_the_choices(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        ABFTConfig(**kwargs)


def test_interval_of_an_unknown_section_raises():
    with pytest.raises(ValueError, match="unknown section 'attn'"):
        ABFTConfig().interval("attn")
