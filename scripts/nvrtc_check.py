"""Compile our CUDA kernels' sources with NVRTC on a machine without a GPU (this one), so that a
syntax or type error shows before device time is spent; prints each build's registers and spills.

    python scripts/nvrtc_check.py [--arch sm_90] [--cache ~/.cache/mlx-dflash-nvrtc]

MLX builds an ``mx.fast.cuda_kernel`` source as the body of a ``__global__`` function whose
parameters are the inputs (with ``NAME_shape`` / ``NAME_strides`` where the body reads them) and
outputs, template arguments as ``constexpr`` / ``using`` lines first (``custom_kernel.cpp``). This
script wraps each body the same way, under stand-ins for MLX's ``Shape`` and ``Strides`` types, and
compiles it with NVIDIA's NVRTC and CUDA headers from PyPI (``nvidia-cuda-nvrtc``,
``nvidia-cuda-runtime``, the versions MLX's CUDA 13 wheel takes; downloaded once into
``--cache``). A clean build here is no proof that MLX's own build passes (its header differs);
the GPU tests are (``tests/test_cuda_attention.py``, ``tests/test_delta_rule.py``).
"""

import argparse
import ctypes
import subprocess
import sys
import zipfile
from pathlib import Path

from mlx_dflash import cuda_attention, delta_rule

WHEELS = ("nvidia-cuda-nvrtc==13.0.88", "nvidia-cuda-runtime==13.0.96")
PREAMBLE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
struct Shape { int d[8]; __device__ int operator[](int i) const { return d[i]; } };
struct Strides { long long d[8]; __device__ long long operator[](int i) const { return d[i]; } };
"""
# (name, source, inputs as (name, type), outputs, template arguments of each build)
KERNELS = [
    ("block_attention", cuda_attention._SOURCE, [("q", "T"), ("k", "T"), ("v", "T"), ("mask", "bool")], [("out", "T")],
     [{"T": t, "D": d, "Warps": cuda_attention.WARPS, "MaskKind": kind, "ScaleBits": 1036831949}
      for t in ("__nv_bfloat16", "float") for d in (64, 256) for kind in (0, 2)]),
    ("gated_delta_steps", delta_rule._STEPWISE_CUDA_SOURCE,
     [("q", "InT"), ("k", "InT"), ("v", "InT"), ("g", "InT"), ("beta", "InT"), ("state_in", "float")],
     [("y", "InT"), ("state_out", "float"), ("states", "float")],
     [{"InT": t, "Dk": 128, "Dv": 128, "Hk": 16, "Hv": 32, "SaveStates": save}
      for t in ("__nv_bfloat16", "float") for save in (True, False)]),
]


def nvrtc_library(cache: Path) -> ctypes.CDLL:
    """NVRTC from the PyPI wheels, downloaded and unpacked into ``cache`` once."""
    lib = cache / "nvidia/cu13/lib"
    if not (lib / "libnvrtc.so.13").exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64",
                        "-d", str(cache), *WHEELS], check=True)
        for wheel in cache.glob("*.whl"):
            zipfile.ZipFile(wheel).extractall(cache)
    ctypes.CDLL(str(next(lib.glob("libnvrtc-builtins.so.*"))), mode=ctypes.RTLD_GLOBAL)  # (found by soname)
    return ctypes.CDLL(str(lib / "libnvrtc.so.13"))


def wrapped(name: str, body: str, inputs, outputs, template: dict) -> str:
    """The body as MLX's custom kernel would wrap it (with the stand-in types)."""
    def typed(t: str) -> str:  # a type template argument's name -> the type
        return template.get(t, t)

    params = []
    for n, t in inputs:
        params.append(f"const {typed(t)}* {n}")
        params += [f"const __grid_constant__ {kind} {n}_{suffix}" for kind, suffix in (("Shape", "shape"), ("Strides", "strides"))
                   if f"{n}_{suffix}" in body]
    params += [f"{typed(t)}* {n}" for n, t in outputs]
    constants = [f"  using {k} = {v};" if isinstance(v, str) else
                 f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower() if isinstance(v, bool) else v};"
                 for k, v in template.items()]
    return PREAMBLE + f"__global__ void {name}({', '.join(params)}) {{\n" + "\n".join(constants) + body + "\n}\n"


def compile_source(nvrtc: ctypes.CDLL, source: str, options: list[str]) -> tuple[int, str]:
    program = ctypes.c_void_p()
    nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kernel.cu", 0, None, None)
    encoded = [o.encode() for o in options]
    rc = nvrtc.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    return rc, log.value.decode()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="sm_90", help="an H200 is sm_90")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache/mlx-dflash-nvrtc")
    args = parser.parse_args()
    nvrtc = nvrtc_library(args.cache)
    options = [f"--gpu-architecture={args.arch}", "--std=c++17", f"-I{args.cache / 'nvidia/cu13/include'}",
               "--ptxas-options=-v"]
    failed = 0
    for name, body, inputs, outputs, builds in KERNELS:
        for template in builds:
            rc, log = compile_source(nvrtc, wrapped(name, body, inputs, outputs, template), options)
            usage = [line.split("info    : ")[-1] for line in log.splitlines() if "Used" in line or "spill" in line]
            print(f"{name} {template}: {'ok' if rc == 0 else 'FAILED'} | {' | '.join(u.strip() for u in usage)}")
            if rc != 0:
                failed += 1
                print(log)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
