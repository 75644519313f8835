import os

import pytest
import torch

# two pytest-xdist workers share two cores: one intra-op thread each
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
