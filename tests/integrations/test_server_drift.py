"""``aiter-patches drift --server``: the integrations' SGLang targets read statically from the wheel and from drifted copies."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aiter_patches import drift

from .sglang_tree import wheel, write_tree

ROOT = Path(__file__).resolve().parents[2]
FOLD = "sglang_shared_expert_fold"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "aiter_patches", "drift", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_the_wheel_matches_every_server_pin():
    proc = _cli("--server", str(wheel()), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["aiter"]["version"] == "0.5.23"
    by_patch = {}
    for t in rep["targets"]:
        by_patch.setdefault(t["patch"], []).append(t["status"])
    assert by_patch[FOLD] == ["match"] * 4 and by_patch["sglang_takeover"] == ["match"]
    assert {r["status"] for r in rep["relied_on"]} == {"unchanged"} and rep["warnings"] == []


def test_a_drifted_copy_is_reported(tmp_path):
    def edit(qualname, src):
        if qualname == "DeepseekV2MoE.forward_normal":
            return src.replace("leave_output_sum: bool = False,\n    )", "leave_output_sum: bool = False,\n        x=1,\n    )", 1)
        if qualname == "DeepseekV2MoE._forward_shared_experts":
            return src.replace("return None", "return None  # changed")
        return src

    root = write_tree(tmp_path / "drifted", edit)
    report = drift.check(drift.open_server(root))
    status = {t.target.rsplit(".", 1)[-1]: (t.status, t.reason) for t in report.targets if t.patch == FOLD}
    assert status["forward_normal"][0] == "drift" and "extra parameter 'x=1'" in status["forward_normal"][1]
    assert status["_forward_shared_experts"][0] == "match"
    relied = {r.qualname: r.status for r in report.relied_on if r.patch == FOLD}
    assert relied["DeepseekV2MoE._forward_shared_experts"] == "changed"
    assert relied["DeepseekV2MoE.forward_normal"] == "changed"
    assert report.exit_code == 1
    takeover = [t for t in report.targets if t.patch == "sglang_takeover"]
    assert takeover and takeover[0].status == "missing"  # not in the small tree


def test_not_a_server_source(tmp_path):
    (tmp_path / "x.whl").write_bytes(b"not a zip")
    with pytest.raises(drift.SourceUnreadable):
        drift.open_server(tmp_path / "x.whl")
    proc = _cli("--server", str(tmp_path))
    assert proc.returncode == 2 and "no sglang/ or vllm/ package" in proc.stderr


def test_the_text_report_names_the_server_it_read():
    proc = _cli("--server", str(wheel()))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0].startswith(f"sglang: {wheel()}"), proc.stdout.splitlines()[0]


def test_the_servers_are_the_packages_the_patches_target(tmp_path):
    """The reader names no server: a patch on another server's code is checked the same way."""
    from aiter_patches.registry import Patch, Target
    from aiter_patches.signatures import Pin

    assert drift.server_packages() == ("sglang", "vllm")
    toy = Patch("toy_server", "t", (Target("tgi.layers", "Layer.forward", (Pin("p", "(self, x)"),),
                                           lambda fn, site: fn),))
    assert drift.server_packages([toy]) == ("tgi",)
    (tmp_path / "tgi").mkdir()
    (tmp_path / "tgi" / "__init__.py").write_text("")
    (tmp_path / "tgi" / "layers.py").write_text("class Layer:\n    def forward(self, x): ...\n")
    report = drift.check(drift.open_server(tmp_path, ["tgi"]), [toy])
    assert report.library == "tgi" and [(t.target, t.status) for t in report.targets] == [
        ("tgi.layers.Layer.forward", "match")]
    with pytest.raises(drift.SourceUnreadable, match="no sglang/ or vllm/ package"):  # not a registered one
        drift.open_server(tmp_path)
