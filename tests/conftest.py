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
