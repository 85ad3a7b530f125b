"""The counters on Prometheus (issue 33): read back through ``prometheus_client``'s own text parser.

One process: the collector on the default ``REGISTRY`` gives each patch's counts at scrape time. Multiprocess
mode (``PROMETHEUS_MULTIPROC_DIR``): worker processes push their counts into the dir's files, and the
registry SGLang's ``/metrics`` builds (a ``CollectorRegistry`` with a ``MultiProcessCollector``) sums them,
a forked child's only its own. Without ``prometheus_client``, or with ``AITER_PATCHES_PROMETHEUS=0``,
nothing is set up and nothing raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

prometheus_client = pytest.importorskip(
    "prometheus_client", reason="prometheus_client is not installed (it is in the test extra: pip install -e '.[test]')")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import aiter_patches  # noqa: E402
from aiter_patches import prometheus_export as pe  # noqa: E402
from aiter_patches import registry  # noqa: E402
from aiter_patches_standin import ROOT as STUB_ROOT  # noqa: E402
from helpers.standin import use_stub_aiter  # noqa: E402

MX = "moe_sort_mx_quant"
GEMM = "gemm_out_zeroed"


def series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of the ``aiter_patches_`` counters in an exposition text,
    as ``prometheus_client``'s parser reads it (each family typed ``counter``)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("aiter_patches_"):
            continue
        assert family.type == "counter", family
        for s in family.samples:
            if s.name.endswith("_total"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def key(metric: str, **labels: str):
    return (metric + "_total", tuple(sorted(labels.items())))


def of_patch(got: dict, patch: str) -> dict:
    return {k: v for k, v in got.items() if dict(k[1])["patch"] == patch}


def scrape() -> dict:
    return series(prometheus_client.generate_latest(prometheus_client.REGISTRY).decode())


@pytest.fixture
def fresh(monkeypatch):
    """The export taken down; set up again by the next apply(), under this test's environment."""
    for name in (pe.SWITCH_ENV, pe.INTERVAL_ENV, *pe.MULTIPROC_ENVS):
        monkeypatch.delenv(name, raising=False)
    pe._reset_for_tests()
    yield
    pe._reset_for_tests()


@pytest.fixture
def applied(fresh):
    with use_stub_aiter():
        import aiter.fused_moe  # noqa: F401

        aiter_patches.apply()
        aiter_patches.reset_stats()
        yield


# ---------------------------------------------------------------- one process

def test_one_process_exports_each_patchs_counts_at_scrape_time(applied):
    assert pe.mode() == pe.COLLECTOR
    c = registry.counters(MX)
    for _ in range(3):
        c.hit()
    c.fallback("topk_ids not contiguous")
    c.fallback("topk_ids not contiguous")
    c.fallback("inside CUDA-graph capture with a plan not yet checked against AITER")
    c.failed(RuntimeError("boom"), "moe_sort_mx_quant kernel")
    c.checked(True)
    c.checked(True)
    c.checked(False)
    got = scrape()
    assert of_patch(got, MX) == {
        key(pe.FAST, patch=MX): 3.0,
        key(pe.FALLBACK, patch=MX, reason="topk_ids not contiguous"): 2.0,
        key(pe.FALLBACK, patch=MX, reason="inside CUDA-graph capture with a plan not yet checked against AITER"): 1.0,
        key(pe.ERRORS, patch=MX, kind="moe_sort_mx_quant kernel: RuntimeError"): 1.0,
        key(pe.CHECKS, patch=MX, result="passed"): 2.0,
        key(pe.CHECKS, patch=MX, result="failed"): 1.0,
    }
    # every applied patch has its series, at 0 before its first call; a patch not applied and never called none
    applied_names = {p["name"] for p in aiter_patches.status()["patches"] if p["state"] == "applied"}
    assert {dict(k[1])["patch"] for k in got} == applied_names
    assert got[key(pe.FAST, patch=GEMM)] == 0.0 and key(pe.FAST, patch="sglang_takeover") not in got
    registry.counters(MX).hit()  # read at the scrape: the next one sees the call
    assert scrape()[key(pe.FAST, patch=MX)] == 4.0


def test_a_scrape_never_fails_because_of_the_counters(applied, monkeypatch):
    def broken():
        raise RuntimeError("a counter that cannot be read")

    monkeypatch.setattr(pe, "own_counts", broken)
    text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert series(text) == {} and "# TYPE aiter_patches_fast_calls_total counter" in text


def test_off_with_the_switch(fresh, monkeypatch):
    monkeypatch.setenv(pe.SWITCH_ENV, "0")
    with use_stub_aiter():
        import aiter.fused_moe  # noqa: F401

        aiter_patches.apply()
        registry.counters(MX).hit()
        assert pe.mode() == pe.OFF
        assert scrape() == {}


@pytest.mark.parametrize("raw", ["-5", "abc", "inf", "0"])
def test_a_bad_interval_warns_and_keeps_the_default(raw, monkeypatch, caplog):
    from aiter_patches import env_flags

    monkeypatch.setattr(env_flags, "_warned", set())
    monkeypatch.setenv(pe.INTERVAL_ENV, raw)
    with caplog.at_level("WARNING", logger="aiter_patches"):
        assert pe.interval() == pe.DEFAULT_INTERVAL_S
    assert [r for r in caplog.records if pe.INTERVAL_ENV in r.getMessage()]
    monkeypatch.setenv(pe.INTERVAL_ENV, "2.5")
    assert pe.interval() == 2.5


# ---------------------------------------------------------------- processes

WORKER = textwrap.dedent("""
    import json, os, sys, threading, time
    import aiter_patches
    from aiter_patches import prometheus_export as pe, registry
    assert sys.modules.get("prometheus_client") is None  # not at import: when a patch applies
    aiter_patches.apply()
    import aiter.fused_moe
    c = registry.counters("moe_sort_mx_quant")
    plan = json.loads(sys.argv[1])
    def count(part):
        for _ in range(part.get("fast", 0)):
            c.hit()
        for reason, n in part.get("fallback", {}).items():
            for _ in range(n):
                c.fallback(reason)
        for _ in range(part.get("errors", 0)):
            c.failed(RuntimeError("boom"), "moe_sort_mx_quant kernel")
        for ok in part.get("checks", []):
            c.checked(ok)
    count(plan["parent"])
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("aiter_patches-prometheus"))
    print(json.dumps({"mode": pe.mode(), "threads": threads, "prometheus_client": "prometheus_client" in sys.modules}))
    sys.stdout.flush()
    if plan.get("exit_hard"):
        os._exit(0)  # no exit push
    if "child" in plan:
        pid = os.fork()
        if pid == 0:
            count(plan["child"])
            time.sleep(plan["child_sleep"])
            os._exit(0)  # as multiprocessing's fork workers leave: no atexit, the interval thread's pushes only
        os.waitpid(pid, 0)
        count(plan.get("parent_after", {}))
        print("CHILD", pid)
""")


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AITER_PATCHES") and k not in pe.MULTIPROC_ENVS}
    env["PYTHONPATH"] = os.pathsep.join([STUB_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["TRITON_INTERPRET"] = "1"
    env.update(extra)
    return env


def start(plan: dict, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(plan)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=worker_env(**env))


def finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.splitlines()[0]), out


def server_metrics(monkeypatch, directory) -> dict:
    """What SGLang's ``/metrics`` serves (``sglang/srt/utils/common.py:2843-2853``, vLLM's alike): a fresh
    ``CollectorRegistry`` with a ``MultiProcessCollector`` over ``PROMETHEUS_MULTIPROC_DIR``."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg)
    return series(generate_latest(reg).decode())


def test_multiprocess_mode_sums_the_workers(tmp_path, monkeypatch):
    one = {"parent": {"fast": 3, "fallback": {"a": 2}, "checks": [True]}}
    two = {"parent": {"fast": 4, "fallback": {"a": 1, "b": 1}, "errors": 1, "checks": [True, False]}}
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), pe.INTERVAL_ENV: "3600"}  # their exit pushes the counts
    procs = [start(one, **env), start(two, **env)]
    infos = [finish(p)[0] for p in procs]
    assert all(i["mode"] == pe.MULTIPROCESS and i["threads"] == ["aiter_patches-prometheus"] for i in infos)
    assert len(list(tmp_path.glob("counter_*.db"))) == 2  # one file per process
    got = server_metrics(monkeypatch, tmp_path)
    assert of_patch(got, MX) == {
        key(pe.FAST, patch=MX): 7.0,
        key(pe.FALLBACK, patch=MX, reason="a"): 3.0,
        key(pe.FALLBACK, patch=MX, reason="b"): 1.0,
        key(pe.ERRORS, patch=MX, kind="moe_sort_mx_quant kernel: RuntimeError"): 1.0,
        key(pe.CHECKS, patch=MX, result="passed"): 2.0,
        key(pe.CHECKS, patch=MX, result="failed"): 1.0,
    }
    assert got[key(pe.FAST, patch=GEMM)] == 0.0  # applied, never called: its series is there


def test_the_applied_patches_series_are_there_at_0_before_any_push_of_counts(tmp_path, monkeypatch):
    info, _ = finish(start({"parent": {}, "exit_hard": True}, PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
                           **{pe.INTERVAL_ENV: "3600"}))
    assert info["mode"] == pe.MULTIPROCESS
    got = server_metrics(monkeypatch, tmp_path)
    assert got[key(pe.FAST, patch=MX)] == got[key(pe.CHECKS, patch=MX, result="failed")] == 0.0
    assert got[key(pe.FAST, patch=GEMM)] == 0.0


def test_a_forked_child_pushes_its_own_counts_on_its_interval(tmp_path, monkeypatch):
    plan = {"parent": {"fast": 5}, "child": {"fast": 2, "fallback": {"in the child": 1}}, "child_sleep": 1.0,
            "parent_after": {"fallback": {"in the parent": 1}}}
    info, out = finish(start(plan, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), **{pe.INTERVAL_ENV: "0.2"}))
    child = int(out.split()[-1])
    assert info["mode"] == pe.MULTIPROCESS
    assert (tmp_path / f"counter_{child}.db").exists()  # the child's own file, written by its interval thread
    got = server_metrics(monkeypatch, tmp_path)
    assert got[key(pe.FAST, patch=MX)] == 7.0  # the parent's 5 and the child's own 2, not the 5 it inherited
    assert got[key(pe.FALLBACK, patch=MX, reason="in the child")] == 1.0
    assert got[key(pe.FALLBACK, patch=MX, reason="in the parent")] == 1.0


def test_without_prometheus_client_nothing_is_set_up(tmp_path):
    script = ("import sys\nsys.modules['prometheus_client'] = None  # not importable: find_spec gives None\n"
              + WORKER)
    proc = subprocess.run([sys.executable, "-c", script, json.dumps({"parent": {"fast": 2}})], capture_output=True,
                          text=True, env=worker_env(PROMETHEUS_MULTIPROC_DIR=str(tmp_path)), timeout=120)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.splitlines()[0])
    assert info == {"mode": pe.UNAVAILABLE, "threads": [], "prometheus_client": True}  # True: the None entry
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_off_with_the_switch_in_multiprocess_mode(tmp_path):
    info, _ = finish(start({"parent": {"fast": 2}}, PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
                           **{pe.SWITCH_ENV: "0"}))
    assert info == {"mode": pe.OFF, "threads": [], "prometheus_client": False}
    assert list(tmp_path.iterdir()) == []


HELD = textwrap.dedent("""
    import os, signal, sys, threading, time
    import aiter_patches
    from aiter_patches import prometheus_export as pe, registry
    aiter_patches.apply()
    import aiter.fused_moe
    from prometheus_client import mmap_dict
    c = registry.counters("moe_sort_mx_quant")
    write = mmap_dict.MmapedDict.write_value
    inside = threading.Event()
    def slow_write(self, *args, **kwargs):  # runs under prometheus_client's one lock of the process's values
        inside.set()
        time.sleep(0.5)
        return write(self, *args, **kwargs)
    mmap_dict.MmapedDict.write_value = slow_write
    c.hit()
    pusher = threading.Thread(target=pe.push)
    pusher.start()
    inside.wait()
    pid = os.fork()  # while the push is inside prometheus_client's lock
    if pid == 0:
        signal.alarm(15)  # a hung child must not outlive the test
        mmap_dict.MmapedDict.write_value = write
        c.hit(); c.hit(); pe.push()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    pusher.join()
    print("CHILD", pid, status)
""")


def test_a_fork_during_a_push_leaves_the_child_able_to_count(tmp_path, monkeypatch):
    """``prometheus_client``'s multiprocess values share one plain lock: a fork while our push held it would
    leave it held in the child, for every metric of the server. The fork waits for the push to end."""
    proc = subprocess.run([sys.executable, "-c", HELD], capture_output=True, text=True, timeout=120,
                          env=worker_env(PROMETHEUS_MULTIPROC_DIR=str(tmp_path), **{pe.INTERVAL_ENV: "3600"}))
    assert proc.returncode == 0, proc.stderr
    _, child, status = proc.stdout.split()
    assert status == "0", proc.stderr
    assert server_metrics(monkeypatch, tmp_path)[key(pe.FAST, patch=MX)] == 3.0  # the parent's 1, the child's 2
