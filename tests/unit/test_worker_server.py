"""A process started right after the worker server was stopped gets a fresh server.

multiprocessing keeps one fork server per process and takes it for alive until it has
exited. `stop_worker_server` kills it; a process started in the moment before it died
connected to the dying server and failed with EOFError (seen under load in the test
suite, whose worlds share the server with in-process `partita train` calls, and what a
second `partita train` in one Python session would meet). The stop now waits for the
exit, so the next start makes a new server.

Run in a fresh interpreter, so this test's servers are not the test session's.
"""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import multiprocessing, os
from partita import launch

context = multiprocessing.get_context("forkserver")
for _ in range(5):
    for _ in range(2):  # start a server, then use it once more
        child = context.Process(target=os.getpid)
        child.start()
        child.join(30)
        assert child.exitcode == 0, child.exitcode
    launch.stop_worker_server()
print("ok")
"""


def test_a_process_started_after_the_stop_gets_a_fresh_server():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok"], done.stdout + done.stderr[-2000:]
