import pytest
import torch

from tests.distributed.pool import RankPool


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
