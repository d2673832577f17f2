import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    """Tiny matmuls on 2 busy cores are far slower with 2 OpenMP threads fighting the test ranks."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
