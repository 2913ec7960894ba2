"""The learner's case: ranks launched from a Jupyter kernel, then the interrupt button.

Drives a real IPython kernel through jupyter_client, as JupyterLab does: the interrupted cell
ends with KeyboardInterrupt within seconds, no rank survives, and the next cell runs.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers import is_running

jupyter_client = pytest.importorskip("jupyter_client")  # installed with jupyterlab

LAUNCH_SLEEPERS = """
import os, time
from engine import launch
def sleeper(rank, world_size):
    open(os.path.join({pid_dir!r}, f"{{rank}}.pid"), "w").write(str(os.getpid()))
    time.sleep(3600)
launch(sleeper, 3, timeout=600)
"""


def _reply(kc, msg_id, timeout):
    while True:
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


@pytest.mark.timeout(180)
def test_interrupting_the_kernel_stops_every_rank_and_the_kernel_stays_usable(tmp_path):
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:
        msg_id = kc.execute(LAUNCH_SLEEPERS.format(pid_dir=str(tmp_path)))
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert len(pids) == 3, "the ranks did not start"

        start = time.monotonic()
        km.interrupt_kernel()
        content = _reply(kc, msg_id, timeout=30)
        assert time.monotonic() - start < 5
        assert content["status"] == "error" and content["ename"] == "KeyboardInterrupt"
        assert not [p for p in pids if is_running(p)], "ranks outlived the interrupt"

        again = _reply(kc, kc.execute("assert launch(lambda r, ws: r, 2, quiet=True) == [0, 1]"),
                       timeout=60)
        assert again["status"] == "ok", again
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
