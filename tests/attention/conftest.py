"""Fixtures shared by the attention tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def sm90(device):
    """The test device, where it is an sm_90 GPU (the Gluon kernels' only target); otherwise the test skips."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("the Gluon kernels run on sm_90 only")
    return device
