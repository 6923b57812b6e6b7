"""The CUDA tier: every test in tests/gpu is marked ``gpu`` and skipped, with the reason
"needs CUDA", when ``torch.cuda.is_available()`` is False. After each test, what it left
behind is collected and the host memory of offloaders it did not restore is unregistered,
so one test's leftovers cannot disturb the next."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offload.runtime.hostmem import drain_retired

GPU_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if GPU_TESTS not in Path(item.path).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def collect_leftovers() -> Iterator[None]:
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.synchronize()
        drain_retired()

