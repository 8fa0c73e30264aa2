import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
