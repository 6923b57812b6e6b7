"""Forwards of offloaded models run without autograd here, as inference does: `offload`
refuses a forward that would record autograd history through offloaded weights
(`tests/executors/test_autograd.py` tests that refusal, under ``torch.enable_grad()``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def no_autograd() -> Iterator[None]:
    with torch.no_grad():
        yield
