"""Each patch declares its own verify check; verify finds it, and the stand-in's modules, through the registry."""

import sys

import pytest

from aiter_patches import verify
from aiter_patches.core import declarations
from aiter_patches.patches import gemm_out_zeroed
from helpers import registry_view, standin


def test_every_patch_that_applies_on_the_stand_in_declares_a_check_verify_can_call():
    for name in registry_view.stand_in_names():
        check = registry_view.patch(name).check
        assert check is not None, name
        assert callable(verify.resolve_check(check)), name


def test_a_check_declared_as_a_function_is_the_one_beside_its_patch():
    assert gemm_out_zeroed.PATCH.check is gemm_out_zeroed.check
    assert verify.resolve_check(gemm_out_zeroed.check) is gemm_out_zeroed.check


def test_a_check_named_by_module_and_function_is_imported_when_resolved():
    fn = verify.resolve_check("aiter_patches.core.declarations:CheckResult")
    assert fn is declarations.CheckResult


@pytest.mark.parametrize("bad", ["aiter_patches.checks", ":f", "aiter_patches.checks:"])
def test_a_malformed_check_name_says_what_to_declare(bad):
    with pytest.raises(ValueError, match="module:function"):
        verify.resolve_check(bad)


def test_the_stand_in_targets_imported_are_the_registrys():
    expected = sorted({m for n in registry_view.names() for m in registry_view.modules(n)
                       if registry_view.on_stand_in(m)})
    with standin.use_stub_aiter():
        assert standin.import_stand_in_targets() == expected
        assert all(m in sys.modules for m in expected)
    assert expected and not standin.stand_in_has("sglang") and standin.stand_in_has("aiter.ops.gemm_op_a8w8")
