"""A failing test's report carries the last log lines of every server it ran (quern_testing.start_quern):
those started during the test and those still running (a module's shared server), so that a red run
can be read without running it again."""
import time

import pytest

import quern_testing


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup":
        item.quern_started_at = time.time()
    if not report.failed:
        return
    since = getattr(item, "quern_started_at", time.time())
    shown = 0
    for started, proc in quern_testing.STARTED:
        if started < since and proc.poll() is not None:
            continue  # an earlier test's server, gone
        tail = list(getattr(proc, "quern_log_tail", ()))
        state = "running" if proc.poll() is None else f"exited with {proc.returncode}"
        report.sections.append((f"quern server pid {proc.pid} ({state}): its last {len(tail)} log lines",
                                "".join(tail) or "(nothing logged)\n"))
        shown += 1
        if shown == 6:
            break
