"""The CPU BLAS switch (mlx_dflash/blas.py): OpenBLAS preloaded, its kernels fit to the CPU."""

import os
import subprocess
import sys

import pytest

from mlx_dflash import blas

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx2", "fma", "sse3"}


@pytest.mark.parametrize("detected, flags, expected", [
    ("Prescott", AVX512, "SkylakeX"),  # a VM hiding its model: the flags know better
    ("Prescott", {"avx2", "fma", "sse3"}, "Haswell"),
    ("Nehalem", {"avx2", "fma"}, "Haswell"),
    ("Prescott", {"sse3"}, None),  # nothing better to offer
    ("Haswell", AVX512, None),  # OpenBLAS chose AVX2 kernels for a CPU it knows: left alone
    ("SkylakeX", AVX512, None),
    (None, AVX512, None),  # not OpenBLAS
])
def test_better_core_only_replaces_pre_avx2_kernels(detected, flags, expected):
    assert blas.better_core(detected, flags) == expected


def _clean_env(**extra) -> dict:
    drop = ("LD_PRELOAD", "OPENBLAS_CORETYPE", "_MLX_DFLASH_REEXEC", "MLX_DFLASH_BLAS")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def _run(code: str, env: dict) -> str:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def _detected(path: str) -> str:
    """The kernels OpenBLAS picks by itself (this test process may run with OPENBLAS_CORETYPE)."""
    return _run(f"from mlx_dflash.blas import openblas_core; print(openblas_core({path!r}))", _clean_env()).strip()


needs_openblas = pytest.mark.skipif(not (sys.platform.startswith("linux") and blas.openblas_path()),
                                    reason="needs a Linux OpenBLAS")


@needs_openblas
def test_reexec_preloads_openblas_with_kernels_for_the_cpus_flags():
    path = blas.openblas_path()
    detected = _detected(path)
    expected = blas.better_core(detected, blas.cpu_flags())
    code = ("from mlx_dflash.blas import use_fast_blas, openblas_core; use_fast_blas(); import os; "
            f"print(os.environ['LD_PRELOAD'], os.environ.get('OPENBLAS_CORETYPE'), openblas_core({path!r}))")
    preload, coretype, running = _run(code, _clean_env()).split()
    assert preload == path and coretype == str(expected) and running == (expected or detected)
    # the user's own choice stands
    assert _run(code, _clean_env(OPENBLAS_CORETYPE="Haswell")).split()[1:] == ["Haswell", "Haswell"]


@needs_openblas
def test_doctor_names_the_kernels_and_the_variable_to_set():
    path = blas.openblas_path()
    code = "from mlx_dflash.blas import status; print(status())"
    chosen = _run(code, _clean_env(LD_PRELOAD=path, OPENBLAS_CORETYPE="Haswell", _MLX_DFLASH_REEXEC="1"))
    assert "Haswell kernels: OPENBLAS_CORETYPE=Haswell" in chosen and "export" not in chosen
    own = _run(code, _clean_env(LD_PRELOAD=path, _MLX_DFLASH_REEXEC="1"))
    detected = _detected(path)
    better = blas.better_core(detected, blas.cpu_flags())
    assert f"{detected} kernels" in own
    assert (f"export OPENBLAS_CORETYPE={better}" in own) == (better is not None)
