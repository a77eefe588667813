"""tests.helpers.Proc, the child process every integration test starts: stopping it closes the file its output
went to (hundreds of processes per suite run must not keep hundreds of descriptors open until the collector
finds them) while what it printed stays readable."""

from __future__ import annotations

import os
import sys

from tests.helpers import Proc, wait_until


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_stop_closes_the_log_and_keeps_the_output() -> None:
    before = _open_fds()
    proc = Proc([sys.executable, "-c", "print('said before exiting')"])
    wait_until(lambda: not proc.alive(), timeout=30, what="the child to exit")
    assert "said before exiting" in proc.output()
    assert "said before exiting" in proc.stop()
    assert _open_fds() <= before  # the log file (and the pipe-less child) hold no descriptor of ours any more
    assert "said before exiting" in proc.output() and "said before exiting" in proc.stop()


def test_a_running_child_stopped_by_the_context_manager_leaves_nothing_open() -> None:
    before = _open_fds()
    with Proc([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]) as proc:
        wait_until(lambda: "up" in proc.output(), timeout=30, what="the child's first line")
    assert not proc.alive()
    assert _open_fds() <= before
    assert proc.output().strip() == "up"
