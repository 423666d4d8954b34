"""tests/processes.py: a subprocess that times out takes the processes it started with it."""

import subprocess
import sys
import time

import pytest

from tests import processes


def test_a_timeout_kills_the_processes_the_command_started(tmp_path):
    marker = tmp_path / "grandchild.pid"
    parent = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(marker)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        processes.run([sys.executable, "-c", parent], timeout=10)
    grandchild = int(marker.read_text())
    deadline = time.monotonic() + 10
    while processes.alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes.alive(grandchild), "the command's own child outlived the timeout"


def test_a_command_that_finishes_gives_its_output_and_status():
    done = processes.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                         timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
