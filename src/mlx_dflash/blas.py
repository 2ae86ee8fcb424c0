"""The CPU BLAS: MLX's Linux CPU wheel bundles the reference (netlib) BLAS.

At ~2.5 GFLOP/s it makes a 16-token verify cost many single-token decodes, and
DFlash loses on the CPU. A system OpenBLAS runs the same GEMMs ~60x faster with
identical results. MLX resolves BLAS when it is loaded, so the only switch is
``LD_PRELOAD`` before the process starts: ``use_fast_blas`` re-executes the
current command once with it set when the machine has OpenBLAS.
Set ``MLX_DFLASH_BLAS=bundled`` to keep the bundled BLAS (for measurements).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",  # Debian/Ubuntu libopenblas0-pthread
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblasp.so.0",  # Fedora openblas-threads
    "/usr/lib64/libopenblas.so.0",
]
DEBIAN_PACKAGE = "libopenblas0-pthread"


def openblas_path() -> Optional[str]:
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).exists()), None)


def _cpu_linux() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def status() -> str:
    """One line on which BLAS the CPU path uses here, with the fix when it is the slow one."""
    if not sys.platform.startswith("linux"):
        return "BLAS: platform default (Accelerate on macOS)"
    if not _cpu_linux():
        return "BLAS: not used for MLX on this machine (MLX runs on a GPU)"
    if "openblas" in os.environ.get("LD_PRELOAD", "") or "libblas" in os.environ.get("LD_PRELOAD", ""):
        return f"BLAS: {os.environ['LD_PRELOAD']} (optimised)"
    path = openblas_path()
    if path:
        return f"BLAS: bundled reference BLAS; OpenBLAS found at {path} (mlx-dflash commands switch to it)"
    return (f"BLAS: bundled reference BLAS (~2.5 GFLOP/s, DFlash will be slow); fix: "
            f"sudo apt-get install {DEBIAN_PACKAGE}")


def use_fast_blas() -> None:
    """Re-exec this process with OpenBLAS preloaded when that helps; otherwise return."""
    if os.environ.get("MLX_DFLASH_BLAS") == "bundled" or os.environ.get("_MLX_DFLASH_REEXEC"):
        return
    if "blas" in os.environ.get("LD_PRELOAD", "") or not _cpu_linux():
        return
    path = openblas_path()
    if path is None:
        return
    env = dict(os.environ, LD_PRELOAD=path, _MLX_DFLASH_REEXEC="1")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)


def install_openblas() -> str:
    """Install Debian's OpenBLAS when we can (root + apt); else say exactly what to run."""
    if not sys.platform.startswith("linux"):
        return "nothing to do: the platform BLAS is used"
    if openblas_path():
        return f"OpenBLAS present: {openblas_path()}"
    if shutil.which("apt-get") and os.geteuid() == 0:
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.STDOUT}
        subprocess.run(["apt-get", "update", "-qq"], check=False, **quiet)
        done = subprocess.run(["apt-get", "install", "-y", "-qq", DEBIAN_PACKAGE], check=False, **quiet)
        if done.returncode == 0 and openblas_path():
            return f"installed {DEBIAN_PACKAGE}: {openblas_path()}"
    return f"OpenBLAS not installed; run: sudo apt-get install {DEBIAN_PACKAGE} (or your distribution's OpenBLAS)"
