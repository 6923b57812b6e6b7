"""The CUDA tier: every test in tests/gpu is marked ``gpu`` and skipped, with the reason
"needs CUDA", when ``torch.cuda.is_available()`` is False."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

GPU_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if GPU_TESTS not in Path(item.path).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)
