import pytest

from tests.distributed.pool import RankPool


@pytest.fixture(scope="session")
def pool2():
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    pool = RankPool(4)
    yield pool
    pool.close()
