"""Load a checkpoint one way in a fresh interpreter and report its peak host memory.

Run by `tests/hf/test_host_memory.py` as ``python tests/hf/load_script.py MODE DIR``, one process per measurement, so that each
peak (``VmHWM``, the high-water mark of the resident set) belongs to one way of loading:

- ``baseline DIR``: import torch, transformers (with the Llama model code) and offload,
  and nothing else: the interpreter's and libraries' own footprint.
- ``resident DIR``: `offload.hf.load_on_host`, then one forward.
- ``offload DIR``: `offload.hf.offload_pretrained` with a prefetch config (every
  ``--group-size``-th layer offloaded, depth 2), then one forward; then the peak is reset
  (``5`` written to /proc/self/clear_refs) and ``restore()`` runs, so that the
  ``restored`` stage's ``VmHWM`` is the peak of restoring alone.
- ``disk DIR --host-budget-mib N --spill-dir S``: `offload_pretrained` with a host budget
  (the disk tier; every layer offloaded, depth 2), then one forward; the report adds the
  disk tier's bytes and how many bytes of the checkpoint's files are in the page cache
  after the forward (``mincore``: `cached_bytes`).

It prints one JSON object on stdout: ``VmHWM``, ``VmRSS``, ``RssAnon`` and ``RssFile``
from /proc/self/status after each stage (bytes; ``VmHWM`` is the peak since the start, or
since the reset), the model's bytes and largest tensor, the plan's static buffer and host
bytes, and the seconds each stage took. Without /proc/self/status it exits 3 with a
message saying so. `build` writes the checkpoint the tests measure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STATUS = Path("/proc/self/status")
FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")
MODES = ("baseline", "resident", "offload", "disk")
TOKENS = 8


def memory() -> dict[str, int]:
    """``VmHWM``, ``VmRSS``, ``RssAnon`` and ``RssFile`` of this process, in bytes."""
    found: dict[str, int] = {}
    for line in STATUS.read_text().splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            number, unit = value.split()
            if unit != "kB":
                raise RuntimeError(f"{STATUS}: {key} is in {unit!r}, expected kB")
            found[key] = int(number) * 1024
    missing = [key for key in FIELDS if key not in found]
    if missing:
        raise RuntimeError(f"{STATUS} has no {', '.join(missing)}")
    return found


def reset_peak() -> None:
    """Reset this process's ``VmHWM`` to its current resident set (Linux 4.0 and later)."""
    Path("/proc/self/clear_refs").write_text("5")


def build(directory: Path, *, hidden: int = 1024, layers: int = 8, vocab: int = 8192) -> int:
    """Write a random Llama-shaped float32 checkpoint to `directory`, sharded (several
    files and an index) with ``save_pretrained``; returns its parameters' bytes.

    The defaults give 478 MB: 8 layers of 50 MB (width 1024, MLP 2816) and untied
    embeddings and head of 34 MB each, the largest tensors.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    # transformers leaves from_config unannotated: go through Any.
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    # A size per shard that gives several shards: the index is read and each shard checked.
    nbytes: int = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size=f"{max(nbytes // 4 // 1_000_000, 1)}MB")
    return nbytes


def cached_bytes(directory: Path) -> int:
    """Bytes of `directory`'s safetensors files in the page cache (``mincore`` of a private
    mapping of each: asking faults nothing in)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = 0
    for file in sorted(directory.glob("*.safetensors")):
        size = file.stat().st_size
        with file.open("rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as region:
            pages = -(-size // page)
            vector = (ctypes.c_ubyte * pages)()
            address = ctypes.addressof(ctypes.c_char.from_buffer(region))
            if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {file} failed")
            total += sum(1 for v in vector if v & 1) * page
    return total


def _sizes(model: Any) -> dict[str, int]:
    params = list(model.parameters())
    return {
        "model_bytes": sum(p.numel() * p.element_size() for p in params),
        "largest_tensor_bytes": max(p.numel() * p.element_size() for p in params),
    }


def _forward(model: Any) -> None:
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, TOKENS), generator=generator)
    with torch.inference_mode():
        model(input_ids=ids)


def run(mode: str, directory: Path, *, group_size: int = 1, host_budget: int | None = None,
        spill_dir: Path | None = None) -> dict[str, Any]:
    """Do `mode` on `directory`; the report (see the module docstring)."""
    stages: dict[str, dict[str, int]] = {}
    seconds: dict[str, float] = {}
    report: dict[str, Any] = {"mode": mode, "stages": stages, "seconds": seconds}
    import torch
    import transformers
    import transformers.models.llama.modeling_llama  # noqa: F401  (what loading a Llama imports)

    import offload.hf
    from offload import OffloadConfig

    _ = transformers.AutoModelForCausalLM  # transformers imports lazily: resolve what loading uses
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    stages["imported"] = memory()
    if mode != "baseline":
        start = time.monotonic()
        if mode == "resident":
            model = offload.hf.load_on_host(directory)
            offloader = None
        elif mode == "disk":
            config = OffloadConfig(backend="prefetch", group_size=1, prefetch_step=2)
            model, offloader = offload.hf.offload_pretrained(directory, config, host_budget_bytes=host_budget,
                                                             spill_dir=spill_dir)
            tier = offloader.disk_tier
            plan = offloader.plan
            report["plan"] = {"backend": plan.backend.value, "offloaded_layers": len(plan.offloaded_layers),
                              "buffer_bytes": plan.device_bytes_buffers, "host_bytes": plan.host_bytes}
            report["disk"] = None if tier is None else {
                "layers": len(tier.disk_positions), "disk_bytes": tier.disk_bytes,
                "host_tier_bytes": tier.host_tier_bytes, "ring_bytes": tier.staging_ring_bytes,
                "spill_bytes": tier.spill_bytes}
        else:
            config = OffloadConfig(backend="prefetch", group_size=group_size, num_in_group=1, prefetch_step=2)
            model, offloader = offload.hf.offload_pretrained(directory, config)
            plan = offloader.plan
            report["plan"] = {"backend": plan.backend.value, "offloaded_layers": len(plan.offloaded_layers),
                              "buffer_bytes": plan.device_bytes_buffers, "host_bytes": plan.host_bytes}
        seconds["load"] = time.monotonic() - start
        stages["loaded"] = memory()
        report.update(_sizes(model))
        start = time.monotonic()
        _forward(model)
        seconds["forward"] = time.monotonic() - start
        stages["forward"] = memory()
        if mode == "disk" and offloader is not None:
            report["disk"]["read_bytes"] = offloader.stats().disk_bytes_read
            report["cached_bytes"] = cached_bytes(directory)
            return report
        if offloader is not None:
            reset_peak()
            start = time.monotonic()
            offloader.restore()
            seconds["restore"] = time.monotonic() - start
            stages["restored"] = memory()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--group-size", type=int, default=1,
                        help="offload: offload every N-th layer (default 1: every layer)")
    parser.add_argument("--host-budget-mib", type=int, help="disk: the host budget, MiB")
    parser.add_argument("--spill-dir", type=Path, help="disk: where a spill file may go")
    args = parser.parse_args(argv)
    if args.mode == "disk" and args.host_budget_mib is None:
        parser.error("disk needs --host-budget-mib")
    if not STATUS.is_file():
        print(f"load_script: {STATUS} is missing: peak host memory (VmHWM) cannot be read on this system",
              file=sys.stderr)
        return 3
    budget = args.host_budget_mib << 20 if args.host_budget_mib is not None else None
    print(json.dumps(run(args.mode, args.directory, group_size=args.group_size, host_budget=budget,
                         spill_dir=args.spill_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
