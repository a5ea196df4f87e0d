"""weightsync/bus/workers.py: a job goes to an idle worker, a new thread only when all are busy."""

from __future__ import annotations

import threading

from weightsync.bus.workers import Workers

WAIT_S = 10.0


def test_jobs_in_turn_share_one_daemon_thread():
    w = Workers("t")
    ran = []
    for i in range(5):
        job = w.submit(lambda i=i: ran.append((i, threading.current_thread().name)))
        job.join(WAIT_S)
        assert not job.is_alive()
    assert [i for i, _ in ran] == list(range(5)) and {name for _, name in ran} == {"t-1"}
    assert w.started == 1
    (thread,) = [t for t in threading.enumerate() if t.name == "t-1"]
    assert thread.daemon  # a job stuck in a call that never returns cannot keep the process alive


def test_a_job_while_another_runs_gets_a_thread_of_its_own_and_neither_waits_for_the_other():
    w = Workers("u")
    release, first_running = threading.Event(), threading.Event()

    def blocked():
        first_running.set()
        assert release.wait(WAIT_S)

    first = w.submit(blocked)
    assert first_running.wait(WAIT_S)
    second = w.submit(lambda: None)
    second.join(WAIT_S)
    assert not second.is_alive() and first.is_alive() and w.started == 2
    release.set()
    first.join(WAIT_S)
    assert not first.is_alive()
    for _ in range(3):  # both idle now: no third thread
        w.submit(lambda: None).join(WAIT_S)
    assert w.started == 2


def test_a_job_that_raises_ends_its_join_and_leaves_the_worker_serving(caplog):
    w = Workers("v")

    def boom():
        raise RuntimeError("pack failed")

    job = w.submit(boom)
    job.join(WAIT_S)
    assert not job.is_alive() and "a handed-off job failed" in caplog.text
    ran = []
    w.submit(lambda: ran.append(1)).join(WAIT_S)
    assert ran == [1] and w.started == 1
