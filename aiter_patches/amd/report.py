"""The compile table, the variant counts per configuration, and the verdict.

Why: one row per compiled variant is what a reviewer reads (which kernel, which settings,
what it costs in registers, spills, scratch, LDS, occupancy); the verdict is what CI reads.
A variant fails on a compile error, on scratch (VGPR spills or any private segment), on LDS
over the arch's limit, on a float-to-integer conversion in its IR and on a float narrowing
conversion (their results differ between backends; see resources.py). SGPR spills go to VGPR lanes, not scratch: reported, not failed.
"""

from __future__ import annotations

from collections import defaultdict

from .. import text_table

COLUMNS = ("status", "arch", "kernel", "settings", "tokens", "vgpr", "sgpr", "sgpr_spill", "vgpr_spill",
           "scratch", "lds", "occ", "fp2int", "fround", "sec")
# parameters a row names when they vary (the rest is the same for every variant of the kernel)
_SKIP = {"num_stages"}


def _tokens(ts: set) -> str:
    if not ts:
        return ""
    lo, hi = min(ts), max(ts)
    return str(lo) if lo == hi else f"{lo}..{hi}"


def failures(outcome) -> list[str]:
    if not outcome.ok:
        return ["compile error"]
    r = outcome.resources
    why = []
    if r.scratch or r.vgpr_spills:
        why.append(f"scratch {r.scratch} B, {r.vgpr_spills} VGPR spills")
    if r.lds_over:
        why.append(f"LDS {r.lds} B > {r.lds_limit} B")
    if r.fp_to_int:
        why.append(f"{r.fp_to_int} float->int conversions")
    if r.float_narrowing:
        why.append(f"{r.float_narrowing} float narrowing conversions (round on the bits: kernels/rounding.py)")
    return why


def rows(variants, outcomes) -> list[dict]:
    by_kernel = defaultdict(list)
    for v in variants:
        by_kernel[v.qualname].append(v)
    varying = {k: [p for p in sorted({p for v in vs for p in v.params})
                   if p not in _SKIP and len({repr(v.params.get(p)) for v in vs}) > 1]
               for k, vs in by_kernel.items()}
    out = []
    for v, o in zip(variants, outcomes):
        settings = " ".join(f"{p}={v.params.get(p)}" for p in varying[v.qualname])
        row = {"status": "ok" if not failures(o) else "FAIL", "arch": v.arch, "kernel": v.qualname,
               "settings": settings, "tokens": _tokens(v.tokens), "sec": f"{o.seconds:.1f}"}
        if o.ok:
            r = o.resources
            row.update(vgpr=r.vgprs + r.agprs, sgpr=r.sgprs, sgpr_spill=r.sgpr_spills, vgpr_spill=r.vgpr_spills,
                       scratch=r.scratch, lds=f"{r.lds / 1024:.1f}/{r.lds_limit // 1024}K", occ=r.occupancy,
                       fp2int=r.fp_to_int, fround=r.float_narrowing)
        else:
            row["settings"] = f"{settings}  error: {o.error}"
        out.append(row)
    return out


def counts_per_config(variants) -> dict[tuple[str, str], int]:
    """(arch, configuration) -> distinct variants it launches (all kernels, all token counts)."""
    n: dict[tuple[str, str], int] = defaultdict(int)
    for v in variants:
        for c in v.configs:
            n[(v.arch, c)] += 1
    return dict(n)


def table(rows_: list[dict], cols=COLUMNS) -> str:
    return text_table.of_dicts(rows_, cols, "(no variants)", text_table.WIDTH)


# The compile rows as text, within 120 columns: each row's settings (and error) on the lines under it, the two
# spill counts and the two conversion counts in one column each (``--json`` keeps every field apart).
TEXT_COLUMNS = ("status", "arch", "kernel", "tokens", "vgpr", "sgpr", "spills", "scratch", "lds", "occ",
                "f2i/rnd", "sec")
TEXT_LEGEND = "spills: SGPR/VGPR spill counts; f2i/rnd: float->int / float narrowing conversions; settings under each row"


def _pair(row: dict, a: str, b: str) -> str:
    return f"{row[a]}/{row[b]}" if a in row and b in row else ""


def text(rows_: list[dict]) -> str:
    """:data:`TEXT_COLUMNS` of the compile rows, each row's settings under it."""
    if not rows_:
        return "(no variants)"
    cells = [[*(r.get(c, "") for c in TEXT_COLUMNS[:6]), _pair(r, "sgpr_spill", "vgpr_spill"),
              *(r.get(c, "") for c in ("scratch", "lds", "occ")), _pair(r, "fp2int", "fround"), r.get("sec", "")]
             for r in rows_]
    body = text_table.lines(TEXT_COLUMNS, cells, text_table.WIDTH, details=[r.get("settings", "") for r in rows_])
    return "\n".join([TEXT_LEGEND, *body])
