"""Run the tests' tiny torch models on one CPU thread, and without autograd.

The test models are a few kilobytes; on a loaded machine with few cores, OpenMP worker
threads waiting on each other turn each microsecond op into ten milliseconds. One thread
keeps the suite fast and changes no result (every comparison is against a resident copy
run in the same process, on the same thread count).

Forwards run under ``torch.no_grad()``, as inference does: `offload` refuses a forward
that would record autograd history through offloaded weights
(`tests/executors/test_autograd.py` tests that refusal under ``torch.enable_grad()``).

Hypothesis runs without its per-example deadline: on a shared 2-core machine an example
that takes 2 ms alone can take 300 ms under load, and a deadline would then fail a test
whose property holds (the properties, not the timings, are what the tests check).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

settings.register_profile("offload", deadline=None)
settings.load_profile("offload")


@pytest.fixture(autouse=True, scope="session")
def one_cpu_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_autograd() -> Iterator[None]:
    with torch.no_grad():
        yield
