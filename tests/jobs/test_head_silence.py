"""A node process whose head stops talking while its connection stays (the head suspended, a link down that TCP has
not given up on yet) stops its job after ``cluster.heartbeat_timeout_s`` of silence, as it does when its input ends
(``launch/nodes/process.py``: ``stop_on_request``, the node process's own watch of its stdin); the head's pings keep
it going. A real process with the real watch, its stdin a pipe this test holds."""

import signal
import subprocess
import sys
import time

from harness import REPO

NODE = "from launcher.launch.nodes.process import stop_on_request; import time; stop_on_request({s}); time.sleep(60)"


def node(silent_s: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", NODE.format(s=silent_s)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_silence_from_the_head_stops_the_node_and_pings_keep_it_going():
    pinged, silent = node(2.0), node(2.0)
    try:
        started = time.monotonic()
        while time.monotonic() - started < 4.0:  # pings every 0.5 s for twice the timeout
            pinged.stdin.write("PING\n")
            pinged.stdin.flush()
            time.sleep(0.5)
        assert silent.wait(timeout=30) == -signal.SIGTERM  # (the agent passes the signal on to its ranks)
        assert pinged.poll() is None, pinged.stderr.read()
        assert "launcher: nothing from the head for 2 s: stopping" in silent.stderr.read()
        pinged.stdin.close()  # the end of input: stopped at once, nothing said of silence
        assert pinged.wait(timeout=30) == -signal.SIGTERM
        assert "nothing from the head" not in pinged.stderr.read()
    finally:
        for proc in (pinged, silent):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
