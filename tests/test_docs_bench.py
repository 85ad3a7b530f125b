"""docs/bench (issue 32): at most 8 files, each naming its command, commit, hardware and date; no dead links."""

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "docs" / "bench"
PAGES = sorted(BENCH.glob("*.md"))


def test_at_most_eight_pages_each_with_command_commit_hardware_and_date():
    assert 0 < len(PAGES) <= 8, [p.name for p in PAGES]
    for page in PAGES:
        text = page.read_text()
        assert re.search(r"python3? (-m aiter_patches|bench/)", text), f"{page.name}: no command"
        assert re.search(r"\b[0-9a-f]{7,40}\b", text), f"{page.name}: no commit"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{page.name}: no date"
        assert re.search(r"H200|CPU", text), f"{page.name}: no hardware"


def test_every_relative_link_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).is_file(), f"{page.name} links {target}"
