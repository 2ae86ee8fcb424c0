"""Two processes of this host through ``mlx.launch`` (ring backend), as the sharded and
data-parallel tests start them."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path


def launch(command: list[str]) -> list[str]:
    """``mlx.launch`` running ``command`` in two processes on ports of their own: every launch's
    default ports are the same, and two launches that start together (test files run side by
    side) would join their processes into one ring."""
    return [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
            "--starting-port", str(_free_port_pair()), "--", *command]


def run_launch(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``command`` in two processes; their output captured as text."""
    return subprocess.run(launch(command), capture_output=True, text=True, timeout=timeout)


def _free_port_pair() -> int:
    """A port p with p and p + 1 free now (the ring's two processes listen on them)."""
    while True:
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                    return port
                except (OSError, OverflowError):  # (taken, or past 65535)
                    continue
