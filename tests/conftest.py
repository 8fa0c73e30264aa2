import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's interpreter on CPU tensors. It is read when a kernel
# module is imported, so it is set here, before any test module imports visattn.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where torch sees no GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # the marker, not a parameter id that says "cuda"
            item.add_marker(skip)
