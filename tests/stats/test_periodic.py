"""periodic.Periodic: the one daemon thread behind the stats lines' interval and the Prometheus push."""

import threading

from aiter_patches import periodic, prometheus_export, stats_log


def _calls_until(n: int):
    calls, done = [], threading.Event()

    def fn():
        calls.append(threading.current_thread())
        if len(calls) >= n:
            done.set()

    return calls, done, fn


def test_it_calls_its_function_from_a_named_daemon_thread_until_stopped():
    calls, done, fn = _calls_until(3)
    p = periodic.Periodic("aiter_patches-test", fn)
    p.start(0.01)
    assert done.wait(5)
    thread = calls[0]
    assert thread.name == "aiter_patches-test" and thread.daemon and thread is not threading.current_thread()
    p.stop()
    assert not thread.is_alive() and not p.running
    n = len(calls)
    threading.Event().wait(0.05)
    assert len(calls) == n  # nothing after stop()


def test_a_raising_function_is_called_again_at_the_next_period(caplog):
    calls = []
    again = threading.Event()

    def fn():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first push failed")
        again.set()

    p = periodic.Periodic("aiter_patches-test", fn)
    with caplog.at_level("DEBUG", logger="aiter_patches"):
        p.start(0.01)
        try:
            assert again.wait(5)
        finally:
            p.stop()
    assert any("aiter_patches-test raised" in r.getMessage() and r.exc_info for r in caplog.records)


def test_start_again_keeps_one_thread_and_forget_drops_it_without_a_join():
    release = threading.Event()
    entered = threading.Event()

    def fn():
        entered.set()
        release.wait(5)

    p = periodic.Periodic("aiter_patches-test", fn)
    p.start(0.01)
    p.start(0.01)  # the first thread stopped: one at a time
    assert [t.name for t in threading.enumerate()].count("aiter_patches-test") == 1
    assert entered.wait(5)
    thread, stop = next(t for t in threading.enumerate() if t.name == "aiter_patches-test"), p._stop
    p.forget()  # as in a forked child: returns at once although a call is in progress
    assert not p.running and thread.is_alive()
    stop.set()  # here, unlike in a child, the thread is still there: end it
    release.set()
    thread.join(5)
    assert not thread.is_alive()


def test_both_reporters_run_their_interval_work_on_it():
    assert isinstance(stats_log._periodic, periodic.Periodic) and stats_log._periodic.name == "aiter_patches-stats"
    assert isinstance(prometheus_export._periodic, periodic.Periodic)
    assert prometheus_export._periodic.name == "aiter_patches-prometheus"
