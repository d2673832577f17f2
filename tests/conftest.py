from pathlib import Path

import pytest
import torch

from tests.distributed.pool import RankPool
from tests.recipe_pool import RecipePool

# The marker every test of a slow folder gets (see tests/README.md); tests/gpu marks itself.
_FOLDER_MARKERS = {
    "distributed": "distributed",
    "recipes": "e2e",
    "reliability": "e2e",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: runs on a pool of gloo rank processes (tests/distributed)")
    config.addinivalue_line(
        "markers", "e2e: recipes through the CLI, injected faults, fuzzed inputs (tests/recipes, tests/reliability)"
    )


def pytest_collection_modifyitems(config, items):
    """Marks every test by its folder, so ``-m "not distributed and not e2e"`` keeps the fast ones."""
    root = Path(__file__).parent
    for item in items:
        parts = item.path.relative_to(root).parts if item.path.is_relative_to(root) else ()
        if len(parts) > 1 and parts[0] in _FOLDER_MARKERS:
            item.add_marker(_FOLDER_MARKERS[parts[0]])


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    """Tiny matmuls on 2 busy cores are far slower with 2 OpenMP threads fighting the test ranks."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def pool2():
    """A persistent pool of 2 gloo ranks shared by every test directory (spawned once)."""
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def recipe_pool():
    """Whole recipes in-process on persistent ranks, for runs whose outputs a test compares (tests/recipe_pool.py)."""
    pool = RecipePool()
    yield pool
    pool.close()
