import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where torch sees no GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
