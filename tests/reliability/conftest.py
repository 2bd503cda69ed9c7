"""The reliability and security suite (issue 10): marked ``reliability``; each test prints its figure.

``SPECULA_LONG=1`` runs the longer variants (more fuzz cases, longer soaks); CI runs the short ones.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/reliability/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.reliability)
