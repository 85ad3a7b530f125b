"""``aiter-patches drift --server`` on vLLM 0.33.0's files (the small zip .ci/wheel_members.py cuts from the wheel)."""

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from aiter_patches import drift

from .vllm_tree import FILES, RUNNER, SHARED, members, write_tree

ROOT = Path(__file__).resolve().parents[2]
FOLD = "vllm_shared_expert_fold"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "aiter_patches", "drift", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def _wheel_members():
    spec = importlib.util.spec_from_file_location("wheel_members", ROOT / ".ci" / "wheel_members.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_release_files_match_every_vllm_pin():
    proc = _cli("--server", str(members()), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["aiter"]["version"] == "0.33.0"
    fold = [t["status"] for t in rep["targets"] if t["patch"] == FOLD]
    assert fold == ["match"] * 4  # aiter.fused_moe is AITER's, not vLLM's: the AITER drift check reads it
    relied = [r for r in rep["relied_on"] if r["patch"] == FOLD]
    assert len(relied) == 7 and {r["status"] for r in relied} == {"unchanged"}
    assert [(t["target"], t["status"]) for t in rep["targets"] if t["patch"] == "vllm_gemm_out_zeroed"] == [
        ("vllm._aiter_ops._rocm_aiter_gemm_a8w8_blockscale_bpreshuffle_impl", "match")]
    gemm = [r for r in rep["relied_on"] if r["patch"] == "vllm_gemm_out_zeroed"]
    assert [r["qualname"] for r in gemm] == ["AiterFp8BlockScaledMMKernel.apply_block_scaled_mm",
                                             "_rocm_aiter_gemm_a8w8_blockscale_bpreshuffle_impl",
                                             "_rocm_aiter_gemm_a8w8_blockscale_bpreshuffle_fake"]
    assert {r["status"] for r in gemm} == {"unchanged"}


def test_a_drifted_copy_is_reported(tmp_path):
    def edit(member, text):
        if member == SHARED:
            return text.replace("order: SharedExpertsOrder,\n    ):", "order: SharedExpertsOrder,\n        x=1,\n    ):", 1)
        if member == RUNNER:
            return text.replace("fused_output *= self.routed_scaling_factor",
                                "fused_output *= self.routed_scaling_factor * 1.0", 1)
        return text

    report = drift.check(drift.open_server(write_tree(tmp_path / "drifted", edit)))
    status = {t.target.rsplit(".", 2)[-2] + "." + t.target.rsplit(".", 1)[-1]: (t.status, t.reason)
              for t in report.targets if t.patch == FOLD}
    assert status["SharedExperts.forward"][0] == "drift" and "extra parameter 'x=1'" in status["SharedExperts.forward"][1]
    assert status["MoERunner.forward"][0] == "match"
    relied = {r.qualname: r.status for r in report.relied_on if r.patch == FOLD}
    assert relied["MoERunner._maybe_apply_routed_scale_to_output"] == "changed"
    assert relied["MoERunner.forward"] == "unchanged"
    assert report.exit_code == 1


def test_wheel_members_copies_the_files_and_the_packages_above_them(tmp_path):
    wheel = tmp_path / "vllm-9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in ("vllm/__init__.py", "vllm/a/__init__.py", "vllm/a/b.py", "vllm/version.py", "vllm/other.py"):
            z.writestr(name, f"# {name}\n")
    wm = _wheel_members()
    out = tmp_path / "vllm-9-members.zip"
    assert wm.main(["--local", str(wheel), str(out), "vllm/a/b.py"]) == 0
    with zipfile.ZipFile(out) as z:
        assert sorted(z.namelist()) == ["vllm/__init__.py", "vllm/a/__init__.py", "vllm/a/b.py", "vllm/version.py"]
        assert z.read("vllm/a/b.py") == b"# vllm/a/b.py\n"
    assert wm.main(["--local", str(tmp_path / "gone.whl"), str(out), "vllm/a/b.py"]) == 0  # cached: not re-read
    assert wm.main(["--local", str(tmp_path / "gone.whl"), str(out), "vllm/other.py"]) == 1  # the list grew
    assert wm.main(["--local", str(wheel), str(tmp_path / "x.zip"), "vllm/missing.py"]) == 1
    assert not (tmp_path / "x.zip").exists()


def test_the_ci_list_is_what_the_tests_read():
    run = (ROOT / ".ci" / "run").read_text()
    assert all(f in run for f in FILES)


@pytest.mark.parametrize("member", FILES)
def test_the_members_zip_holds_each_file(member):
    with zipfile.ZipFile(members()) as z:
        assert member in z.namelist()
