"""The command line's table within a width (issue 32: status and compile fit 120 columns)."""

from aiter_patches import text_table


def test_a_narrow_table_is_unchanged_by_a_width():
    rows = [["a", "applied", ""], ["longer_name", "x", "why"]]
    assert text_table.lines(["patch", "state", "detail"], rows, 120) == text_table.lines(["patch", "state", "detail"],
                                                                                          rows)


def test_a_wide_table_wraps_its_widest_columns_at_break_points():
    rows = [["p", "applied", "aiter.fused_moe.fused_moe, aiter.fused_moe._moe_sorting_impl", "because " * 6]]
    out = text_table.lines(["patch", "state", "targets", "reason"], rows, 50)
    assert max(len(line) for line in out) <= 50 and not any(line.endswith(" ") for line in out)
    assert out[2].startswith("p      applied  aiter.fused_moe.")  # the narrow columns keep their width
    assert "".join(line[16:].split("  ")[0].strip() for line in out[2:]).replace(" ", "") == \
        rows[0][2].replace(" ", "")  # the wrapped cell reads back whole, in order
    assert all(line[:16].strip() == "" for line in out[3:])  # continuation lines leave the other cells blank


def test_a_cells_own_newlines_are_lines_and_an_unbreakable_word_is_cut():
    assert text_table.wrap("a: x\nb: y", 20) == ["a: x", "b: y"]
    assert text_table.wrap("abcdefghij", 4) == ["abcd", "efgh", "ij"]
    assert text_table.wrap("", 4) == [""]


def test_compile_rows_fit_120_columns_with_their_settings_under_each_row():
    from aiter_patches.amd import report

    settings = " ".join(f"PARAM_{i}=value_{i}" for i in range(30))
    row = {"status": "ok", "arch": "gfx950", "kernel": "_blockscale_gemm_kernel", "settings": settings,
           "tokens": "16384..32768", "vgpr": 128, "sgpr": 96, "sgpr_spill": 1, "vgpr_spill": 0, "scratch": 0,
           "lds": "12.5/160K", "occ": 4, "fp2int": 0, "fround": 2, "sec": "12.3"}
    failed = dict(row, status="FAIL", settings="A=1  error: " + "x" * 300)
    out = report.text([row, failed]).splitlines()
    assert max(len(line) for line in out) <= 120
    assert out[0] == report.TEXT_LEGEND and out[1].split() == list(report.TEXT_COLUMNS)
    assert out[3].split() == ["ok", "gfx950", "_blockscale_gemm_kernel", "16384..32768", "128", "96", "1/0", "0",
                              "12.5/160K", "4", "0/2", "12.3"]
    under = [line for line in out[4:] if line.startswith("    ")]
    assert " ".join(line.strip() for line in under).startswith(settings)  # whole, in order, cut only at spaces
    assert all(p.startswith("PARAM_") for line in under[:2] for p in line.split())
    assert any(line.endswith("error:") for line in out) and out[-1].strip() == "x" * (300 - 2 * 116)
    assert report.text([]) == "(no variants)"
