"""The two other ways in: the AITER_PATCHES_AUTO .pth switch and the vLLM general plugin."""

import importlib.metadata
import tomllib

import pytest

from aiter_patches import auto, vllm_plugin
from helpers import registry_view

from .procs import ROOT, env, python, records, states, summaries

FUSED_MOE = "aiter.fused_moe.fused_moe"  # what the probes below bind with `from aiter.fused_moe import fused_moe`
SITE = "import site, sys; site.addsitedir(sys.argv[1]); print('aiter_patches' in sys.modules)"
PROBE = SITE + "; from aiter.fused_moe import fused_moe; print(getattr(fused_moe, '__aiter_patches__', None))"


@pytest.fixture
def site_dir(tmp_path):
    proc = python("-m", "aiter_patches", "install-auto", "--dir", str(tmp_path), under_run=False)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / auto.PTH_NAME).read_text() == auto.PTH_LINE
    return tmp_path


@pytest.mark.parametrize("value", [None, "0", ""])
def test_the_pth_line_does_nothing_unless_switched_on(site_dir, value):
    e = env() if value is None else env(AITER_PATCHES_AUTO=value)
    proc = python("-c", SITE, str(site_dir), under_run=False, environ=e)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False"], "aiter_patches is not even imported"
    assert proc.stderr == ""


def test_the_pth_line_applies_the_patches_when_switched_on(site_dir):
    proc = python("-c", PROBE, str(site_dir), under_run=False, environ=env(AITER_PATCHES_AUTO="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", registry_view.outermost_at(FUSED_MOE)]
    (record,) = records(proc.stderr).values()
    assert record["via"] == ["auto"] and states(record) == registry_view.expected_on_stand_in()


def test_install_auto_remove(site_dir):
    proc = python("-m", "aiter_patches", "install-auto", "--remove", "--dir", str(site_dir), under_run=False)
    assert proc.returncode == 0 and "removed" in proc.stdout
    assert not (site_dir / auto.PTH_NAME).exists()
    proc = python("-m", "aiter_patches", "install-auto", "--remove", "--dir", str(site_dir), under_run=False)
    assert proc.returncode == 0 and "no aiter_patches_auto.pth" in proc.stdout


def test_vllm_register_reaches_aliases_bound_before_it_and_is_idempotent():
    script = ("from aiter.fused_moe import fused_moe\n"
              "from aiter_patches.vllm_plugin import register\n"
              "register(); register()\n"
              "print(fused_moe.__aiter_patches__)\n")
    proc = python("-c", script, under_run=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == registry_view.outermost_at(FUSED_MOE)
    (line,) = summaries(proc.stderr)  # one apply did everything, the second changed nothing
    applied = registry_view.stand_in_names()
    assert "via vllm_plugin" in line and f"applied {len(applied)} (" in line
    assert "rebound aliases:" in line and "__main__.fused_moe" in line.split("rebound aliases:")[1]
    (record,) = records(proc.stderr).values()
    head = next(p for p in record["patches"] if p["name"] == registry_view.outermost_at(FUSED_MOE))
    fm = next(t for t in head["targets"] if t["location"] == FUSED_MOE)
    assert "__main__.fused_moe" in fm["aliases"]


def _declared_entry_point():
    plugins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    return importlib.metadata.EntryPoint("aiter_patches", plugins["aiter_patches"], "vllm.general_plugins")


def test_pyproject_declares_the_vllm_plugin():
    assert _declared_entry_point().load() is vllm_plugin.register


def test_the_installed_metadata_declares_the_vllm_plugin():
    installed = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
                 if ep.name == "aiter_patches"]
    if not installed:
        pytest.skip("the installed metadata predates the entry point: run `pip install -e .` again")
    assert [ep.value for ep in installed] == [_declared_entry_point().value]
