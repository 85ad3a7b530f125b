"""A seeded fuzz pass over the log reader, ``aiter-patches status --from-log`` (issue 35): on any log, exit 0
(status lines found), 1 (none found) or 2 (unreadable), one-line messages, never a traceback, in bounded time.

The base lines are the package's own: a status line (``process_report.status_line``) of this process's record,
with applied patches, rebound aliases and foreign layers filled in, and stats lines (``stats_log.line``),
behind a server's log prefix. Each run applies a few random mutations to a log of them: bytes flipped,
inserted, cut; a line cut short or run on into the next; a JSON value replaced by a hostile one (huge numbers,
deep nesting, wrong types, NaN); non-UTF-8 bytes; lines of several MB. The log is read in-process, from a
file or from stdin as bytes (``kubectl logs ... | aiter-patches status --from-log -``), with and without
``--json``.

Kept small for CI (a few seconds); ``AITER_PATCHES_LOG_FUZZ_RUNS`` and ``AITER_PATCHES_LOG_FUZZ_SEED`` run a
longer or another pass. A failure names the run, the seed and the mutations, so it replays exactly. Time is
bounded by an alarm per run (generous: a quadratic reader took minutes on a 5 MB line), not by a clock
assertion that a shared CI machine would make flaky.
"""

from __future__ import annotations

import copy
import io
import json
import os
import random
import signal
import sys
import traceback

import pytest

from aiter_patches import cli, process_report, stats_log

RUNS = int(os.environ.get("AITER_PATCHES_LOG_FUZZ_RUNS", "90"))
SEED = int(os.environ.get("AITER_PATCHES_LOG_FUZZ_SEED", "35"))
ALARM_S = 30  # per run; a linear reader takes well under a second on the largest mutant
PREFIX = "2026-12-03 07:00:00,123 INFO "
MX = "moe_sort_mx_quant"

BIG = 10 ** 4300 - 1  # the most digits Python's int parser accepts: two of them summed no longer print
HOSTILE = [0, -1, 2**63, 2**64, BIG, -BIG, 1e308, float("nan"), float("inf"), True, None, "", "x" * 5000,
           "\u2028\ud800", "\x00", [], {}, [[]], {"": {}}, ["outer"] * 3, {"a": BIG}, {"a": -1}, {"a": "1"},
           "DEEP", "DEEP_LIST", "WIDE"]


def _base_status() -> dict:
    """This process's status record, as the package builds it, with applied patches, aliases and layers."""
    rec = process_report.status_record()
    rec["env"] = {"RANK": "3", "LOCAL_RANK": "3"}
    rec["via"] = ["run"]
    rec["process"] = "SpawnProcess-2"
    for i, p in enumerate(rec["patches"]):
        p["state"] = ("applied", "skipped", "pending", "disabled")[i % 4]
        if p["state"] == "pending":
            p["reason"] = "waiting for import of aiter.fused_moe"
        if p["state"] == "applied":
            p["foreign_layers"] = [f"outer tracer{i} on aiter.fused_moe.fused_moe"]
            for t in p["targets"]:
                t["aliases"] = [f"vllm.mod{i}.{t['location'].rpartition('.')[2]}"]
    return rec


def _base_stats(pid: int) -> list[dict]:
    return [{"pid": pid, "patch": MX, "at": "exit", "fast": 1624,
             "fallback": {"stage-1 quant not fused: activation is not silu": 3, "routing is not top-k": 1},
             "errors": {"RuntimeError": 1}, "foreign_layers": ["outer tracer on aiter.fused_moe.fused_moe"]},
            {"pid": pid, "patch": "gemm_out_zeroed", "at": "interval", "fast": 7, "fallback": {}, "errors": {},
             "foreign_layers": []}]


def _hostile(rng: random.Random):
    value = copy.deepcopy(rng.choice(HOSTILE))
    if value == "DEEP":
        depth = rng.choice([50, 900, 5000, 200_000])
        return json.loads("[" * min(depth, 900) + "]" * min(depth, 900)) if depth <= 900 else "RAW" + "[" * depth
    if value == "DEEP_LIST":
        return {"a": [[[[[[[[{"b": [1]}]]]]]]]]}
    if value == "WIDE":
        return [f"outer mod{i} on aiter.fused_moe.fused_moe" for i in range(rng.choice([10, 5000, 60_000]))]
    return value


def _places(node, path=()):
    yield path, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from _places(v, path + (k,))


def _mutate_record(rng: random.Random, rec, log: list[str]) -> str:
    """The record with 1-3 values replaced, dropped or added, as JSON text (a raw deep opening stays raw)."""
    rec = copy.deepcopy(rec)
    raw = None
    for _ in range(rng.randint(1, 3)):
        path, node = rng.choice(list(_places(rec)))
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        value = _hostile(rng)
        if isinstance(value, str) and value.startswith("RAW"):
            raw, value = value[3:], "RAWHERE"
        op = rng.choice(["replace", "replace", "drop", "add"]) if keys else "add"
        log.append(f"{op}@{'/'.join(map(str, path))}:{str(value)[:20]!r}")
        if op == "add":
            if isinstance(node, dict):
                node[rng.choice(["pid", "patches", "fast", "fallback_more", "foreign_layers_more", "x"])] = value
            else:
                node.insert(rng.randint(0, len(node)), value)
        elif op == "drop":
            del node[rng.choice(keys)]
        else:
            node[rng.choice(keys)] = value
    text = json.dumps(rec, separators=(",", ":"), allow_nan=True)
    return text.replace('"RAWHERE"', raw, 1) if raw is not None else text


def _mutate_bytes(rng: random.Random, data: bytes, log: list[str]) -> bytes:
    kind = rng.choice(["flip", "insert", "delete", "truncate", "duplicate", "non_utf8", "huge_line", "join"])
    at = rng.randrange(len(data) + 1)
    log.append(f"{kind}@{at}")
    if kind == "flip" and data:
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == "insert":
        return data[:at] + rng.choice([b"\x00", b"\r", b"\xff\xfe", b"\xef\xbb\xbf", b"{", b"[", b'"', b"\\",
                                       process_report.MARKER.encode(), stats_log.MARKER.encode()]) + data[at:]
    if kind == "delete":
        return data[:at] + data[at + rng.randint(1, 400):]
    if kind == "truncate":
        return data[:at]
    if kind == "duplicate":
        return data[:at] + data[at:at + rng.randint(1, 3000)] * rng.randint(1, 50) + data[at:]
    if kind == "non_utf8":
        return data[:at] + bytes(rng.randrange(128, 256) for _ in range(rng.randint(1, 64))) + data[at:]
    if kind == "huge_line":  # a 5 MB line: markers, brackets or garbage, with a real record at its end or not
        unit = rng.choice([process_report.MARKER.encode() + b"{", b"[", b'{"a":', b"x" * 64,
                           stats_log.MARKER.encode() + b'{"pid":1,"patch":"p","fast":'])
        return data[:at] + b"\n" + unit * (5_000_000 // len(unit)) + data[at:]
    i = data.find(b"\n", at)  # join: this line runs on into the next, as a line cut short by another process
    return data if i < 0 else data[:i] + data[i + 1:]


def _one_log(rng: random.Random, log: list[str]) -> bytes:
    status = _base_status()
    lines = []
    big = rng.random() < 0.1  # counts near the int parser's limit in every process: their sum no longer prints
    if big:
        log.append("big counts")
    for pid in rng.sample(range(100, 200), rng.randint(1, 3)):
        status["pid"] = pid
        text = json.dumps(status, separators=(",", ":"))
        if rng.random() < 0.5:
            text = _mutate_record(rng, status, log)
        lines.append(PREFIX + process_report.MARKER + text if rng.random() < 0.9 else
                     process_report.status_line(status))
        for rec in _base_stats(pid):
            if big:
                rec["fast"], rec["fallback"] = BIG, {"a": BIG}
            if rng.random() < 0.4:
                lines.append(PREFIX + stats_log.MARKER + _mutate_record(rng, rec, log))
            else:
                lines.append(PREFIX + stats_log.line(rec))
    lines.insert(rng.randrange(len(lines) + 1), PREFIX + "sglang: ready to roll")
    data = "\n".join(lines).encode() + b"\n"
    for _ in range(rng.randint(0, 3)):
        data = _mutate_bytes(rng, data, log)
    return data


class _Slow(Exception):
    pass


def _alarm(signum, frame):
    raise _Slow


def _read(argv: list[str], stdin: bytes | None, monkeypatch) -> int:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    return cli.main(argv)


@pytest.mark.parametrize("chunk", range(3))
def test_mutated_logs_exit_0_1_or_2_in_bounded_time_and_never_print_a_traceback(tmp_path, capsys, monkeypatch,
                                                                                   chunk):
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for run in range(chunk, RUNS, 3):
            rng = random.Random(f"{SEED}-{run}")
            log: list[str] = []
            data = _one_log(rng, log)
            from_stdin = rng.random() < 0.25
            path = tmp_path / f"{run}.log"
            path.write_bytes(data)
            argv = ["status", "--from-log", "-" if from_stdin else str(path)] + (["--json"] if rng.random() < 0.3
                                                                                 else [])
            replay = f"run {run} (seed {SEED}; {argv[2:]}; stdin={from_stdin}; mutations {log})"
            signal.alarm(ALARM_S)
            try:
                code = _read(argv, data if from_stdin else None, monkeypatch)
            except _Slow:
                pytest.fail(f"{replay}: took over {ALARM_S} s")
            except BaseException:  # noqa: BLE001 - the point: nothing may escape
                pytest.fail(f"{replay} raised:\n{traceback.format_exc()}")
            finally:
                signal.alarm(0)
            out = capsys.readouterr()
            assert code in (0, 1, 2), replay
            assert "Traceback" not in out.err and "Traceback" not in out.out, replay
            if code == 0 and "--json" in argv:
                json.loads(out.out)
            if code == 0:
                assert out.out.startswith("process ") or "--json" in argv, replay
            if code == 1:
                assert out.out == "" and "no 'aiter_patches status:' lines in " in out.err, replay
    finally:
        signal.signal(signal.SIGALRM, old)
