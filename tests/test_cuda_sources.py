"""Our CUDA kernels' sources compile, here on a machine without a GPU: each ``mx.fast.cuda_kernel``
body wrapped as MLX wraps it (``custom_kernel.cpp``: a ``__global__`` function of the inputs, with
``NAME_shape`` / ``NAME_strides`` where the body reads them, and the outputs; template arguments
as ``constexpr`` / ``using`` lines first), under stand-ins for MLX's ``Shape`` and ``Strides``, built
by NVIDIA's NVRTC and CUDA headers from PyPI (the test extra's ``nvidia-cuda-nvrtc`` and
``nvidia-cuda-runtime``, Linux x86-64) for an H200 (sm_90), with no register spills. Not MLX's own
build (its header differs): the kernels' GPU tests remain the proof that they run and are right.
``pytest tests/test_cuda_sources.py -s`` prints each build's registers."""

import ctypes
import sys
from functools import lru_cache
from pathlib import Path
from typing import Optional

import pytest

from mlx_dflash import cuda_attention, delta_rule

PREAMBLE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
struct Shape { int d[8]; __device__ int operator[](int i) const { return d[i]; } };
struct Strides { long long d[8]; __device__ long long operator[](int i) const { return d[i]; } };
"""
# (name, source, inputs as (name, type), outputs, template arguments of one build)
BUILDS = [
    *(("block_attention", cuda_attention._SOURCE, [("q", "T"), ("k", "T"), ("v", "T"), ("mask", "bool")],
       [("out", "T")], {"T": t, "D": d, "Warps": cuda_attention.WARPS, "MaskKind": kind, "ScaleBits": 1036831949})
      for t in ("__nv_bfloat16", "float") for d in (64, 256) for kind in (0, 1, 2)),
    *(("gated_delta_steps", delta_rule._STEPWISE_CUDA_SOURCE,
       [("q", "InT"), ("k", "InT"), ("v", "InT"), ("g", "InT"), ("beta", "InT"), ("state_in", "float")],
       [("y", "InT"), ("state_out", "float"), ("states", "float")],
       {"InT": t, "Dk": 128, "Dv": 128, "Hk": 16, "Hv": 32, "SaveStates": save})
      for t in ("__nv_bfloat16", "float") for save in (True, False)),
]


def _cuda_root() -> Optional[Path]:
    """site-packages/nvidia/cu13 with NVRTC and the CUDA headers, if the wheels are installed."""
    for entry in map(Path, sys.path):
        root = entry / "nvidia" / "cu13"
        if (root / "lib" / "libnvrtc.so.13").exists() and (root / "include" / "cuda_bf16.h").exists():
            return root
    return None


ROOT = _cuda_root()


@lru_cache(maxsize=1)
def _nvrtc() -> ctypes.CDLL:
    builtins = next((ROOT / "lib").glob("libnvrtc-builtins.so.*"))
    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)  # (NVRTC opens it by name: found loaded)
    return ctypes.CDLL(str(ROOT / "lib" / "libnvrtc.so.13"))


def wrapped(name: str, body: str, inputs: list, outputs: list, template: dict) -> str:
    """The kernel source as MLX's custom kernel builds it, with the stand-in types."""
    params = []
    for n, t in inputs:
        params.append(f"const {template.get(t, t)}* {n}")
        params += [f"const __grid_constant__ {kind} {n}_{suffix}"
                   for kind, suffix in (("Shape", "shape"), ("Strides", "strides")) if f"{n}_{suffix}" in body]
    params += [f"{template.get(t, t)}* {n}" for n, t in outputs]
    constants = "\n".join(_template_line(k, v) for k, v in template.items())
    return PREAMBLE + f"__global__ void {name}({', '.join(params)}) {{\n" + constants + body + "\n}\n"


def _template_line(key: str, value) -> str:
    """One template argument as MLX declares it: a type, a bool or an int."""
    if isinstance(value, str):
        return f"  using {key} = {value};"
    if isinstance(value, bool):
        return f"  constexpr bool {key} = {str(value).lower()};"
    return f"  constexpr int {key} = {value};"


def compile_for_h200(source: str) -> tuple[int, str]:
    """(NVRTC's status, its log with ptxas' report)."""
    nvrtc = _nvrtc()
    program = ctypes.c_void_p()
    nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kernel.cu", 0, None, None)
    options = [b"--gpu-architecture=sm_90", b"--std=c++17", f"-I{ROOT / 'include'}".encode(), b"--ptxas-options=-v"]
    status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return status, log.value.decode()


NEEDS_NVRTC = pytest.mark.skipif(ROOT is None, reason="NVRTC and CUDA headers from PyPI: the test extra on Linux x86-64")


@NEEDS_NVRTC
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: f"{b[0]}-" + "-".join(str(v) for v in b[4].values()))
def test_kernel_source_compiles_without_spills(build):
    name, body, inputs, outputs, template = build
    status, log = compile_for_h200(wrapped(name, body, inputs, outputs, template))
    print(name, template, " | ".join(line.split(":", 1)[-1].strip() for line in log.splitlines() if "Used" in line))
    assert status == 0, log
    assert " 0 bytes spill stores" in log, log


@NEEDS_NVRTC
def test_a_broken_source_fails():
    """The check can fail: a syntax error in a kernel body is reported."""
    name, body, inputs, outputs, template = next(b for b in BUILDS if b[0] == "gated_delta_steps")
    status, log = compile_for_h200(wrapped(name, body.replace("float recall = 0.0f;", "float recall = ;"),
                                           inputs, outputs, template))
    assert status != 0 and "error" in log
