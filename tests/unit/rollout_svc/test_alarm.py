"""rollout_svc.sync.alarm: the prepared sync's deadline on one long-lived thread."""

from __future__ import annotations

import threading
import time

from rollout_svc.sync.alarm import Alarm


def _fired(alarm_calls, n, timeout=5.0):
    deadline = time.monotonic() + timeout
    while len(alarm_calls) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    return list(alarm_calls)


def test_fires_once_after_its_delay_and_a_re_arm_replaces_the_armed_call():
    calls, a = [], Alarm("t")
    t0 = time.monotonic()
    a.arm(0.1, lambda: calls.append(("first", time.monotonic() - t0)))
    a.arm(0.2, lambda: calls.append(("second", time.monotonic() - t0)))
    got = _fired(calls, 1)
    time.sleep(0.2)
    assert [c[0] for c in calls] == ["second"] and got[0][1] >= 0.2 and not a.armed


def test_a_cancelled_alarm_never_fires_and_the_next_arm_still_does():
    calls, a = [], Alarm("t")
    a.arm(0.05, lambda: calls.append("cancelled"))
    a.cancel()
    time.sleep(0.15)
    assert calls == []
    a.arm(0.01, lambda: calls.append("next"))
    assert _fired(calls, 1) == ["next"]


def test_many_syncs_use_one_thread_and_a_failing_call_does_not_stop_it():
    calls, a = [], Alarm("one-thread")
    a.arm(0.0, lambda: 1 / 0)
    time.sleep(0.05)
    for _ in range(200):  # a prepare/commit cycle per sync: arm, then cancel at commit
        a.arm(30, lambda: calls.append("late"))
        a.cancel()
    a.arm(0.0, lambda: calls.append("after the failure"))
    assert _fired(calls, 1) == ["after the failure"]
    assert sum(t.name == "one-thread" for t in threading.enumerate()) == 1


def test_a_steady_prepare_commit_cycle_never_wakes_the_thread_and_an_earlier_deadline_does():
    """Each prepare arms a deadline later than the one the thread already waits for, each commit cancels:
    neither wakes the thread (no switch on the handler's path); a deadline earlier than its wait does."""
    calls, a = [], Alarm("steady")
    a.arm(60, lambda: calls.append("first"))
    deadline = time.monotonic() + 5
    while a._wakes_at is None and time.monotonic() < deadline:  # the thread is in its timed wait
        time.sleep(0.001)
    assert a._wakes_at is not None
    woken = a.wakeups
    for i in range(100):
        a.cancel()
        a.arm(60 + i / 1000, lambda: calls.append("late"))
    assert a.wakeups == woken and calls == []
    a.arm(0.01, lambda: calls.append("earlier"))
    assert a.wakeups == woken + 1
    assert _fired(calls, 1) == ["earlier"]
