import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
if "PYTEST_XDIST_WORKER" in os.environ:
    # NOTE: a worker a core (pyproject.toml's -n auto): a second intra-op thread in each would only wait for a core
    # the other worker holds (the one_thread fixture below). Set before torch is imported, so the runs the tests
    # launch inherit it as well (tests/helpers.py env() sets the same).
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread for a test of tiny tensors (`pytestmark = pytest.mark.usefixtures("one_thread")`).

    NOTE: a matmul of a 16-wide model has nothing to split, and on a busy 2-core machine a second
    OpenMP thread only spin-waits for a core (measured: 95 s instead of 5 s for one such file).
    """
    from labs.common import single_thread

    with single_thread():
        yield


@pytest.fixture(scope="session")
def drill_runs(tmp_path_factory):
    """The shrunk fault drills, each trained once per session (tests/helpers.py DrillRuns)."""
    from helpers import DrillRuns

    return DrillRuns(tmp_path_factory.mktemp("drills"))

