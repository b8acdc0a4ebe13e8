"""A stopped `run_distributed` leaves no rank running; a killed launcher, no server.

A SIGTERM sent to the calling process alone (`kill PID`, as a user or a scheduler stops
a bench) raises `Stopped` there, and its ranks, children of the fork server, get no
signal of their own. They must end with it: stopping `partita bench zero` that way once
left its ranks training for minutes, and printing rows, after the command had said that
every process was stopped.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from partita.proc_stat import process_state

SCRIPT = '''
import os, sys, time
from partita.errors import Stopped, stop_on_signals
from partita.local_world import run_distributed

def rank(r, world):
    # One write per line: a pipe keeps a write this short whole, where print's separate
    # writes of text and newline from two ranks can interleave ("26182rank 26183").
    os.write(1, f"rank {os.getpid()}\\n".encode())
    time.sleep(300)

if __name__ == "__main__":
    stop_on_signals()
    try:
        run_distributed(rank, 2, timeout=600)
    except Stopped:
        print("stopped", flush=True)
        sys.exit(143)
'''


def _running(pid: int) -> bool:
    # A zombie has ended; the process that inherits it may never reap it.
    return process_state(pid) not in (None, "Z", "X")


def test_a_stop_sent_to_the_caller_alone_ends_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "stop_me.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                     daemon=True).start()
    ranks: list[int] = []
    try:
        while len(ranks) < 2:
            line = lines.get(timeout=120)
            ranks += [int(pid) for pid in re.findall(r"rank (\d+)", line)]
        proc.send_signal(signal.SIGTERM)  # the caller only, not its process group
        assert proc.wait(timeout=60) == 143
        deadline = time.monotonic() + 10
        while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in ranks if _running(pid)], "ranks outlived the stop"
    finally:
        proc.kill()
        for pid in ranks:  # whatever the outcome, leave nothing behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


ORPHANED_SERVER = '''
import os, signal
from multiprocessing import forkserver
import torch
from partita import launch

launch.start_worker_server(())
os.write(1, f"server {forkserver._forkserver._forkserver_pid}\\n".encode())
os.kill(os.getpid(), signal.SIGKILL)  # a launcher killed: no handler, no clean-up
'''


def test_the_worker_server_of_a_killed_launcher_ends(tmp_path: Path) -> None:
    """The launcher's worker server is a fork of it (`start_worker_server`). It must end
    once the launcher is gone and it has no workers left, as a freshly started server
    does: the fork closes its copy of the pipe whose end tells the server so."""
    out = tmp_path / "out"
    with out.open("w") as stdout:  # a file, not a pipe: a server left running holds it
        done = subprocess.run([sys.executable, "-c", ORPHANED_SERVER], stdout=stdout,
                              stderr=subprocess.STDOUT, timeout=120)
    assert done.returncode == -signal.SIGKILL, out.read_text()[-2000:]
    server = int(re.findall(r"server (\d+)", out.read_text())[0])
    try:
        deadline = time.monotonic() + 10
        while _running(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(server), "the worker server outlived its launcher"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGKILL)
