"""Tensors over parts of one device allocation, each over a storage of its own.

A slot's static buffers lie back to back in one allocation (an arena, `offload.pure.plan.blocks`)
so that a layer is one copy. As views of one tensor they would alias: torch.compile then
treats the whole arena as one mutated input (AOTAutograd's synthetic bases, which refuse
views of different dtypes and fail `assert_size_stride`; inductor clones the arena rather
than mutate two views of one storage in place). So each buffer gets a storage of its own
over its bytes (``torch._C._construct_storage_from_data_pointer``, as inductor's CUDA graph
trees make theirs), which owns nothing; the arena stays alive because that storage's Python
object holds it, and PyTorch keeps a storage's Python object (with its attributes) alive as
long as any tensor uses the storage.

Such storages own nothing, so the CUDA caching allocator does not know them:
``Tensor.record_stream`` on them does nothing (the executor orders its streams with
events, and frees arenas only after synchronising), and sending one to another process
(``torch.multiprocessing``, CUDA IPC) is refused.
"""

from __future__ import annotations

import torch

__all__ = ["ARENA_ATTRIBUTE", "CAN_CARVE", "carve"]

#: The attribute of each carved storage that holds the arena.
ARENA_ATTRIBUTE = "_offload_arena"

#: Whether this torch can make a storage over part of an allocation (every release since
#: 2.1 can); without it there are no arenas, and every buffer is an allocation of its own.
CAN_CARVE = hasattr(torch._C, "_construct_storage_from_data_pointer")


def carve(arena: torch.Tensor, offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
          dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape`, `stride` and `dtype` over the bytes of `arena` (a flat ``uint8``
    tensor) from `offset`, over a storage of its own that keeps `arena` alive.

    Raises:
        ValueError: the tensor does not fit in the arena from `offset`, or `offset` is not
            aligned to `dtype`.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    span = (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * itemsize if all(shape) else 0
    if offset < 0 or offset % itemsize or offset + span > arena.numel():
        raise ValueError(f"a {shape} {dtype} tensor does not fit at byte {offset} of a {arena.numel()}-byte arena")
    storage = torch._C._construct_storage_from_data_pointer(arena.data_ptr() + offset, arena.device, span)
    setattr(storage, ARENA_ATTRIBUTE, arena)
    return torch.empty(0, dtype=dtype, device=arena.device).set_(storage, 0, shape, stride)
