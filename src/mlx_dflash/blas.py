"""The CPU BLAS: MLX's Linux CPU wheel bundles the reference (netlib) BLAS.

It makes a 16-token verify cost many single-token decodes, and DFlash loses on
the CPU; a system OpenBLAS runs the same GEMMs far faster with identical results. MLX resolves BLAS when it is loaded, so the only switch is
``LD_PRELOAD`` before the process starts: ``use_fast_blas`` re-executes the
current command once with it set when the machine has OpenBLAS.
Set ``MLX_DFLASH_BLAS=bundled`` to keep the bundled BLAS (for measurements).

OpenBLAS picks its kernels by the CPU's model number, and a virtual machine that reports a
generic model ("Intel(R) Xeon(R) Processor") gets its oldest x86-64 kernels (Prescott, SSE3)
though the CPU has AVX-512. Its ISA flags tell better: where OpenBLAS settled for pre-AVX2
kernels that the flags beat, the re-executed process gets ``OPENBLAS_CORETYPE`` (unless the
user set it): docs/cpu-blas.md gives the difference it makes.
"""

from __future__ import annotations

import ctypes
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


# OpenBLAS's x86 kernel families without AVX2, which a CPU with these flags outruns
PRE_AVX2_CORES = {"katmai", "coppermine", "northwood", "prescott", "banias", "core2", "penryn", "dunnington",
                  "nehalem", "sandybridge", "atom", "opteron", "opteron_sse3", "barcelona", "bobcat", "bulldozer",
                  "piledriver", "steamroller"}
CORES_BY_FLAGS = [("SkylakeX", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
                  ("Haswell", {"avx2", "fma"})]


def openblas_path() -> Optional[str]:
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).exists()), None)


def _preloaded_blas() -> Optional[str]:
    return next((p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if "blas" in p), None)


def openblas_core(path: str) -> Optional[str]:
    """The kernel family OpenBLAS at ``path`` runs in this process's environment."""
    try:
        corename = ctypes.CDLL(path).openblas_get_corename
    except (OSError, AttributeError):  # not loadable, or not OpenBLAS
        return None
    corename.restype = ctypes.c_char_p
    return corename().decode()


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def better_core(detected: Optional[str], flags: set[str]) -> Optional[str]:
    """OpenBLAS's kernel family for these CPU flags where it ``detected`` a pre-AVX2 one; else None."""
    if detected is None or detected.lower() not in PRE_AVX2_CORES:
        return None
    return next((core for core, needs in CORES_BY_FLAGS if needs <= flags), None)


def core_to_set(detected: Optional[str]) -> Optional[str]:
    """The ``OPENBLAS_CORETYPE`` this process should have where OpenBLAS ``detected`` these
    kernels: a better family for the CPU's flags, unless the user chose one; else None."""
    return None if "OPENBLAS_CORETYPE" in os.environ else better_core(detected, cpu_flags())


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
    preloaded = _preloaded_blas()
    if preloaded:
        core, chosen = openblas_core(preloaded), os.environ.get("OPENBLAS_CORETYPE")
        kernels = f", {core} kernels{f': OPENBLAS_CORETYPE={chosen}' if chosen else ''}" if core else ""
        better = core_to_set(core)
        fix = f"; its {better} kernels fit this CPU: export OPENBLAS_CORETYPE={better}" if better else ""
        return f"BLAS: {preloaded} (optimised{kernels}){fix}"
    path = openblas_path()
    if path:
        return f"BLAS: bundled reference BLAS; OpenBLAS found at {path} (mlx-dflash commands switch to it)"
    return (f"BLAS: bundled reference BLAS (~2.5 GFLOP/s, DFlash will be slow); fix: "
            f"sudo apt-get install {DEBIAN_PACKAGE}")


def slow_blas_warning() -> Optional[str]:
    """The one-line fix, when this process runs MLX's CPU path on the bundled reference BLAS
    (Python scripts do unless they switch; the CLI and the tests switch by themselves)."""
    if os.environ.get("MLX_DFLASH_BLAS") == "bundled" or not _cpu_linux() or _preloaded_blas():
        return None
    path = openblas_path()
    if path is None:
        return (f"warning: MLX runs on its bundled reference BLAS here, ~10x slower than OpenBLAS; "
                f"install it (sudo apt-get install {DEBIAN_PACKAGE}, or mlx-dflash doctor --fix)")
    return ("warning: MLX runs on its bundled reference BLAS here, ~10x slower than OpenBLAS; call "
            "mlx_dflash.use_fast_blas() first thing in your script (it restarts the script with OpenBLAS), "
            f"or start Python with LD_PRELOAD={path}")


def use_fast_blas() -> None:
    """Re-exec this process with OpenBLAS preloaded, and its kernels fit to the CPU's flags,
    when that helps; otherwise return."""
    if os.environ.get("MLX_DFLASH_BLAS") == "bundled" or os.environ.get("_MLX_DFLASH_REEXEC"):
        return
    if not _cpu_linux():
        return
    preloaded = _preloaded_blas()
    path = preloaded or openblas_path()
    if path is None:
        return
    env = dict(os.environ, _MLX_DFLASH_REEXEC="1")
    if not preloaded:
        env["LD_PRELOAD"] = path
    core = core_to_set(openblas_core(path))
    if core:
        env["OPENBLAS_CORETYPE"] = core
    elif preloaded:
        return  # nothing to change
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
