"""The skip summary (issue 32): one line per distinct reason with its count, at most 15 lines in all."""

from types import SimpleNamespace

from conftest import MAX_REASONS, skip_summary_lines


def skipped(reason: str, where=("tests/x.py", 3)):
    return SimpleNamespace(skipped=True, longrepr=(*where, f"Skipped: {reason}"))


def test_one_line_per_reason_with_its_count_most_first():
    reports = [skipped("needs a GPU")] * 70 + [skipped("no wheel", ("tests/y.py", 9))] * 3 + [skipped("b\n  c")]
    assert skip_summary_lines(reports) == ["74 skipped, 3 reasons (pytest -rs lists each test):",
                                           "   70  needs a GPU", "    3  no wheel", "    1  b c"]


def test_many_reasons_stay_within_15_lines_and_long_ones_are_cut():
    reports = [skipped(f"reason {i}") for i in range(40)] + [skipped("x" * 500)] * 2
    lines = skip_summary_lines(reports)
    assert len(lines) == MAX_REASONS + 2 <= 15 and max(len(line) for line in lines) <= 160
    assert lines[1].startswith("    2  xxx") and lines[1].endswith("...")
    assert lines[-1] == f"{40 - (MAX_REASONS - 1):5d}  in {40 - (MAX_REASONS - 1)} more reasons"


def test_no_skip_no_summary_and_other_outcomes_are_not_counted():
    failed = SimpleNamespace(skipped=False, longrepr="boom")
    assert skip_summary_lines([failed]) == []
