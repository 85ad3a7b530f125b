"""``status --from-log`` reads hostile long lines in time linear in their length (issue 35 item 6): a status
record of 40,000 foreign layers or 60,000 aliases, a one-line JSON export of 60,000 log records. Asserted
through behaviour under a generous subprocess timeout (main needed a minute and more per line), never a clock."""

import json
import subprocess
import sys

from aiter_patches import process_report as pr
from aiter_patches import stats_log

REAL = {"pid": 4242, "process": "p", "title": None, "env": {}, "via": ["apply"],
        "patches": [{"name": "moe_sort_mx_quant", "state": "applied", "reason": "", "targets": []}]}


def status(foreign: int = 0, aliases: int = 0, pid: int = 7) -> dict:
    return {"pid": pid, "process": "p", "title": None, "env": {}, "via": [], "patches": [
        {"name": "moe_sort_mx_quant", "state": "applied", "reason": "",
         "foreign_layers": [f"outer mod{i} on aiter.fused_moe.fused_moe" for i in range(foreign)],
         "targets": [{"aliases": [f"mod{i}.fused_moe" for i in range(aliases)]}]}]}


def from_log(tmp_path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "server.log"
    path.write_text(text, encoding="utf-8")
    return subprocess.run([sys.executable, "-m", "aiter_patches", "status", "--from-log", str(path)],
                          capture_output=True, text=True, timeout=45)


def test_a_5_mb_one_line_json_export_is_read_and_the_real_line_after_it_found(tmp_path):
    export = json.dumps([f"2026-12-03 INFO {pr.MARKER}" + json.dumps({"pid": i, "patches": []}) for i in range(75_000)])
    assert len(export) > 5_000_000
    got = from_log(tmp_path, export + "\n" + pr.MARKER + json.dumps(REAL) + "\n")
    assert got.returncode == 0, got.stderr
    assert "process 4242" in got.stdout and "applied 1 (moe_sort_mx_quant)" in got.stdout
    assert "Traceback" not in got.stderr


def test_a_record_of_40000_foreign_layers_and_60000_aliases_gives_one_line_under_the_limit(tmp_path):
    rec = status(foreign=40_000, aliases=60_000)
    got = from_log(tmp_path, pr.MARKER + json.dumps(rec) + "\n")
    assert got.returncode == 0, got.stderr
    (line,) = [x for x in got.stdout.splitlines() if x.startswith("process 7")]
    summary = pr.summary_line(rec)
    assert summary == "aiter_patches: " + line and len(summary.encode()) <= pr.LINE_LIMIT + 64
    assert "(+39" in summary and "(+59" in summary


def test_a_summary_line_shows_as_many_layers_and_aliases_as_fit():
    """The layers and aliases shown plus the "(+N more)" count are all of them, and the line is filled."""
    import re

    for foreign, aliases in ((0, 500), (300, 0), (120, 400), (3, 2)):
        line = pr.summary_line(status(foreign, aliases))
        assert len(line.encode()) <= pr.LINE_LIMIT + 64
        if foreign:
            part = line.split("; foreign layers: ")[1].split("; rebound aliases")[0]
            more = re.search(r"\(\+(\d+) more\)$", part)
            assert part.count(" on aiter.fused_moe.fused_moe") + (int(more[1]) if more else 0) == foreign
        if aliases:
            part = line.split("; rebound aliases: ")[1]
            more = re.search(r" \(\+(\d+) more\)$", part)
            assert len(part.split(", ")) + (int(more[1]) if more else 0) == aliases
            if more:
                assert len(line.encode()) > pr.LINE_LIMIT - 40  # filled up to the limit


def test_many_stats_records_of_many_foreign_layers_sum_each_layer_once():
    recs = [{"pid": p, "patch": "x", "fast": 1, "foreign_layers": [f"outer {i}" for i in range(20_000)]}
            for p in range(3)]
    sums = stats_log.summed(recs)
    assert sums["x"]["processes"] == 3 and len(sums["x"]["foreign_layers"]) == 20_000
