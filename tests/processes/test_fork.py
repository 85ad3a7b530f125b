"""fork() while another thread is inside the registry: the child never hangs and still applies its pending patches."""

import json

from .procs import python

FORK_WHILE_BUSY = r"""
import importlib, importlib.util, json, os, sys, threading, time
import aiter  # the stand-in: the GEMM patch applies, the patches on modules not imported yet stay pending
import aiter_patches
from aiter_patches import registry

def importable(module):  # a patch on a module the stand-in lacks (a server's) stays pending
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False

report = aiter_patches.apply()
modules = {p.name: {t.module for t in p.targets} for p in registry.patches() if p.name in report.pending}
due = [n for n, ms in modules.items() if all(importable(m) for m in ms)]
waiting = sorted({m for n in due for m in modules[n] if m not in sys.modules})
assert waiting, report
stop = threading.Event()

def hammer():  # takes and releases the registry lock as fast as it can
    while not stop.is_set():
        aiter_patches.stats()
        aiter_patches.status()

threading.Thread(target=hammer, daemon=True).start()
time.sleep(0.05)
children = []
for _ in range(20):
    pid = os.fork()
    if pid == 0:
        for m in waiting:
            importlib.import_module(m)
        states = {p["name"]: p["state"] for p in aiter_patches.status()["patches"]}
        os._exit(0 if all(states[n] == "applied" for n in due) else 3)
    children.append(pid)
stop.set()
deadline = time.monotonic() + float(sys.argv[1])
results = {}
while len(results) < len(children):
    for pid in children:
        if pid in results:
            continue
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            results[pid] = os.waitstatus_to_exitcode(status)
        elif time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            results[pid] = "hang"
    time.sleep(0.01)
print(json.dumps({"pending": due, "results": list(results.values())}))
"""


def test_children_forked_while_a_thread_holds_the_registry_lock_import_aiter_and_finish():
    proc = python("-c", FORK_WHILE_BUSY, "60", under_run=False, timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["pending"], "the set-up left no patch pending"
    assert out["results"] == [0] * 20, f"{out['results'].count('hang')} of 20 children hung:\n{proc.stderr[-3000:]}"
