"""Shared fixtures. Like every mlx-dflash command, the suite switches to the
machine's OpenBLAS when there is one (see mlx_dflash/blas.py): same results,
~10x faster on Linux CPUs."""

from mlx_dflash.blas import use_fast_blas


def pytest_configure(config):
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # give the re-executed run the real terminal, not pytest's capture files
        capture.stop_global_capturing()
    use_fast_blas()
    if capture is not None:  # no re-exec happened (no OpenBLAS, or already switched)
        capture.start_global_capturing()

import pytest
from tiny_models import FAMILIES, make_tiny_target


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session", params=[(f, tie) for f in FAMILIES for tie in (True, False)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def tiny_target_path(request, tiny_dir):
    family, tie = request.param
    return make_tiny_target(tiny_dir / f"{family}-{tie}", family, tie=tie)
