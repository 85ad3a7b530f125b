"""Numeric environment variables (issue 32): a value that is not a positive finite number warns once, naming
the variable and the rule, and the default holds; nothing raises."""

import logging

import pytest

from aiter_patches import env_flags

NAME = "AITER_PATCHES_TEST_NUMBER"


@pytest.fixture
def warnings_seen(caplog):
    env_flags._warned.clear()
    caplog.set_level(logging.WARNING, logger="aiter_patches")
    yield lambda: [r.getMessage() for r in caplog.records if NAME in r.getMessage()]
    env_flags._warned.clear()


@pytest.mark.parametrize("raw", ["-5", "abc", "inf", "nan", "1e999", "\u00b2", "0", "1e10"])
def test_a_bad_number_warns_once_then_gives_the_default(monkeypatch, warnings_seen, raw):
    monkeypatch.setenv(NAME, raw)
    for _ in range(3):
        assert env_flags.positive_number(NAME, 7.0, maximum=1e9, unit="seconds") == 7.0
    assert warnings_seen() == [f"{NAME}={raw!r} ignored: the rule is a number of seconds, more than 0, at most 1e+09; "
                               "using the default (7.0)"]


@pytest.mark.parametrize("raw, want", [("", None), ("  ", None), ("2.5", 2.5), (" 60 ", 60.0), ("1e3", 1000.0)])
def test_a_good_number_or_none_is_silent(monkeypatch, warnings_seen, raw, want):
    monkeypatch.setenv(NAME, raw)
    assert env_flags.positive_number(NAME, None, maximum=1e9) == want
    assert warnings_seen() == []


@pytest.mark.parametrize("raw", ["1.5", "-1", "\u00b2", "\u0663", "lots", "1e3"])
def test_a_whole_number_is_ascii_digits(monkeypatch, warnings_seen, raw):
    monkeypatch.setenv(NAME, raw)
    assert env_flags.positive_number(NAME, 256, whole=True, zero_ok=True, unit="MiB") == 256
    assert len(warnings_seen()) == 1 and "the rule is a whole number of MiB, 0 or more" in warnings_seen()[0]


def test_zero_where_zero_is_allowed(monkeypatch, warnings_seen):
    monkeypatch.setenv(NAME, "0")
    assert env_flags.positive_number(NAME, 256, whole=True, zero_ok=True) == 0
    monkeypatch.setenv(NAME, "0512")
    assert env_flags.positive_number(NAME, 256, whole=True, zero_ok=True) == 512
    assert warnings_seen() == []


def test_the_default_text_names_what_the_default_means(monkeypatch, warnings_seen):
    monkeypatch.setenv(NAME, "soon")
    assert env_flags.positive_number(NAME, None, default_text="no periodic lines") is None
    assert warnings_seen()[0].endswith("using the default (no periodic lines)")


@pytest.mark.parametrize("raw, want", [("", 256), ("300", 300), ("-1", -1), ("+7", 7), ("0", 0)])
def test_an_integer_of_any_sign(monkeypatch, warnings_seen, raw, want):
    monkeypatch.setenv(NAME, raw)
    assert env_flags.integer(NAME, 256) == want and warnings_seen() == []


@pytest.mark.parametrize("raw", ["abc", "1.5", "\u00b2", "--1", "1e3"])
def test_not_an_integer_warns_once_then_the_default(monkeypatch, warnings_seen, raw):
    monkeypatch.setenv(NAME, raw)
    assert env_flags.integer(NAME, 256) == 256 and env_flags.integer(NAME, 256) == 256
    assert warnings_seen() == [f"{NAME}={raw!r} ignored: the rule is a whole number; using the default (256)"]
