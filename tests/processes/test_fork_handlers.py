"""The package's fork handling runs in one order: every lock renewed first, then what takes them.

Each case forks in a state where a handler running too early would block on a
lock inherited held from the parent, or would start work twice.
"""

import json

from .procs import python

PRELUDE = r"""
import builtins, importlib, json, os, sys, tempfile, threading, time
tmp = tempfile.mkdtemp(); sys.path.insert(0, tmp)
def mkmod(name, body):
    with open(os.path.join(tmp, name + ".py"), "w") as f:
        f.write(body)
from aiter_patches import registry
from aiter_patches.core import state as core_state
from aiter_patches.registry import Patch, Target
from aiter_patches.signatures import Pin
def factory(inner, site):
    def wrapper(*a, **k):
        site.counters.hit()
        return ("patched", inner(*a, **k))
    return wrapper
def mkpatch(name, module):
    registry.register(Patch(name, name, (Target(module, "f", (Pin("v1", "(x)", "fake"),), factory),)))
"""

# A patch pending on an import another thread finishes just before the fork: the waiter thread, restarted
# in the child, finds the module ready and must get the child's registry lock, not the parent's.
WAITER = PRELUDE + r"""
mkmod("slowmod", "import time, builtins\nwhile not builtins.GO: time.sleep(0.001)\ndef f(x): return x\n")
builtins.GO = False
mkpatch("p_slow", "slowmod")
t = threading.Thread(target=lambda: importlib.import_module("slowmod")); t.start()
while "slowmod" not in sys.modules: time.sleep(0.001)
assert registry.apply(["p_slow"])["p_slow"]["state"] == "pending"
time.sleep(0.6)  # the waiter now polls every 50 ms: the fork lands between two polls
builtins.GO = True; t.join()
pid = os.fork()
if pid == 0:
    deadline = time.monotonic() + 5
    while core_state.states["p_slow"].state != "applied" and time.monotonic() < deadline:
        time.sleep(0.01)
    import slowmod
    os._exit(0 if slowmod.f(1) == ("patched", 1) else 3)
_, status = os.waitpid(pid, 0)
print(json.dumps({"child": os.waitstatus_to_exitcode(status)}))
"""

# A thread inside the foreign-layer memo at the fork (the MoE fallback path reads it).
MEMO = PRELUDE + r"""
import functools
from aiter_patches import foreign_layers
mkmod("fm", "def f(x): return x\n")
import fm
mkpatch("p_fm", "fm")
registry.apply(["p_fm"])
ours = fm.f
@functools.wraps(ours)
def foreign(x): return ours(x)
fm.f = foreign
held, release = threading.Event(), threading.Event()
def holder():
    with foreign_layers._memo_lock:
        held.set(); release.wait()
threading.Thread(target=holder, daemon=True).start(); held.wait()
pid = os.fork()
if pid == 0:
    import faulthandler; faulthandler.dump_traceback_later(5, exit=True)
    os._exit(0 if foreign_layers.outer_layer_name("fm", "f") == "__main__" else 3)
release.set()
_, status = os.waitpid(pid, 0)
print(json.dumps({"child": os.waitstatus_to_exitcode(status)}))
"""

# Threads holding the locks of the kernels, the sort-output pool and the verdict tables at the fork (issue 31):
# the child takes each one on its usual path (keeping a kernel, dropping the pool, checking a code object,
# asking the asm launcher for a kernel, putting a verdict) and must not wait on the parent's.
LOCKS = r"""
import json, os, threading
import triton.runtime.jit  # noqa: F401 - imported before the fork, as a server's first launch does
from aiter_patches import call_key
from aiter_patches.kernels import fast_launch, hip_blockscale_asm as hb
from aiter_patches.patches.moe import sort_scratch
launcher = object.__new__(hb.AsmLauncher)  # no HIP here: a kernel whose load failed before
launcher._lock, launcher._functions = threading.Lock(), {(0, "x.co", "k"): hb._LoadFailed("no HIP")}
hb._launcher = launcher
verdicts = call_key.GuardedVerdicts("t")
locks = [fast_launch._lock, sort_scratch._lock, hb._co_lock, launcher._lock, verdicts._lock]
held, release = threading.Event(), threading.Event()
def holder():
    for lock in locks:
        lock.acquire()
    held.set(); release.wait()
    for lock in locks:
        lock.release()
threading.Thread(target=holder, daemon=True).start(); held.wait()
pid = os.fork()
if pid == 0:
    import faulthandler; faulthandler.dump_traceback_later(10, exit=True)
    fast_launch._kernel_state(object())
    sort_scratch.clear()
    reason = hb._checked_code_object("/nowhere/x.co", "k", "gfx942")
    try:
        hb._get_launcher().function(0, "x.co", "k", "gfx942")
    except RuntimeError:
        pass
    verdicts.put(("k",), (), "verdict")
    os._exit(0 if reason and verdicts.get(("k",), ()) == "verdict" else 3)
release.set()
_, status = os.waitpid(pid, 0)
print(json.dumps({"child": os.waitstatus_to_exitcode(status)}))
"""

# The run/auto/plugin path: bootstrap.start() before the target's import, then a fork: the child has one
# stats thread and writes one exit line per patch.
STATS = r"""
import os; os.environ["AITER_PATCHES_STATS_INTERVAL"] = "0.2"
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(process)d %(message)s")
""" + PRELUDE + r"""
mkmod("sm", "def f(x): return x\n")
mkpatch("p_sm", "sm")
from aiter_patches import bootstrap
bootstrap.start("run")
import sm
assert sm.f(1) == ("patched", 1)
pid = os.fork()
if pid == 0:
    time.sleep(0.5)
    n = [t.name for t in threading.enumerate()].count("aiter_patches-stats")
    print(json.dumps({"threads": n}), flush=True)
    pid2 = os.fork()  # a grandchild: atexit entries must not pile up per generation
    if pid2 == 0:
        sys.exit(0)
    os.waitpid(pid2, 0)
    sys.exit(0)
os.waitpid(pid, 0)
"""


def _child_code(script: str) -> int:
    proc = python("-c", script, under_run=False, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["child"]


def test_a_patch_pending_on_an_import_finished_before_the_fork_applies_in_the_child():
    assert _child_code(WAITER) == 0


def test_a_child_forked_while_a_thread_is_inside_the_foreign_layer_memo_does_not_hang():
    assert _child_code(MEMO) == 0


def test_a_child_forked_while_threads_hold_the_kernels_pool_and_verdict_locks_does_not_hang():
    assert _child_code(LOCKS) == 0


def test_a_forked_child_on_the_run_path_has_one_stats_thread_and_one_exit_line_per_patch():
    proc = python("-c", STATS, under_run=False, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")] == [{"threads": 1}]
    exits: dict[str, int] = {}
    for ln in proc.stderr.splitlines():
        if "aiter_patches stats: " in ln and '"at":"exit"' in ln:
            pid = json.loads(ln.split("aiter_patches stats: ", 1)[1])["pid"]
            exits[pid] = exits.get(pid, 0) + 1
    assert len(exits) == 3 and set(exits.values()) == {1}, proc.stderr[-3000:]
