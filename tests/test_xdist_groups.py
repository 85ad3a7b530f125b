"""The tests that share a costly fixture run in one xdist worker (tests/conftest.py SHARED_SETUP): pytest 9.2
ignores xdist's renamed node ids (pytest-xdist issue 1386), so the scheduler reads the group off the path."""

from types import SimpleNamespace

import conftest


def test_a_shared_setups_tests_are_one_work_unit_and_the_others_one_each():
    sched = conftest.pytest_xdist_make_scheduler(SimpleNamespace(getvalue={"dist": "loadgroup", "tx": ["2*popen"]}.get),
                                                 None)
    scope = sched._split_scope
    assert scope("tests/drift/test_wheel.py::test_a[x]") == scope("tests/drift/test_reader.py::test_b") == "drift"
    assert scope("tests/processes/test_spawn.py::test_x") == "processes/test_spawn.py"
    assert scope("tests/drift/test_wheel.py::test_a@drift") == "drift"  # an xdist that renames node ids again
    for nodeid in ("tests/processes/test_run.py::test_x", "tests/drifts/test_x.py::test_y", "tests/test_cli.py::t[a]"):
        assert scope(nodeid) == nodeid
    assert conftest.pytest_xdist_make_scheduler(SimpleNamespace(getvalue={"dist": "load"}.get), None) is None
