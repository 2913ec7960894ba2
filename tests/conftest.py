"""Shared test setup: the gpu marker, notebook cell timeouts, and a rank runner."""

from __future__ import annotations

import pytest
import torch

NOTEBOOK_CELL_TIMEOUT_S = 600  # longer than any launch timeout a notebook cell uses


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; this machine has none"))
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.timeout(NOTEBOOK_CELL_TIMEOUT_S))
