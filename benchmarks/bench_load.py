"""From checkpoint to ready model: `offload_pretrained` beside `from_pretrained` resident.

Model: a random Llama-shaped checkpoint written with ``save_pretrained`` in several
shards (``--size-gb``: 0.2 by default on the CPU, float32, width 768; 4 on CUDA,
bfloat16, width 4096; the number of layers makes up the size), or with ``--model whisper``
a random Whisper-shaped one (two stacks, an encoder and a decoder, both offloaded; the
forward runs the encoder on random features and the decoder on 8 token ids), or
``--checkpoint DIR``. ``--quantise int8`` (or ``float8``) quantises the linear layers at
load in every row, through transformers' own torchao integration
(``quantization_config=TorchAoConfig(...)``, passed to ``from_pretrained`` and to
`offload_pretrained` alike): the offloaded rows then move the quantised weights' inner
tensors (`offload.model.wrappers`).

Rows, in one run, each measured ``--reps`` times, each time in a fresh process (so that
its peak host memory is its own):

- ``resident``: ``from_pretrained`` into host memory (`offload.hf.load_on_host`); on
  CUDA then ``.to("cuda")`` when the model fits in 90% of the free device memory (else
  the row says it does not fit and the ratios are to the host load);
- ``prefetch``: `offload_pretrained` with prefetch, every 2nd layer offloaded, depth 2;
- ``uva``: `offload_pretrained` with UVA, half of the layers' bytes offloaded.

Per row it prints the median seconds from the start of loading to a ready model (the
libraries and the model's code imported first, not timed; on CUDA synchronised), the
checkpoint's bytes over those seconds (GB/s), the seconds of a first forward of 8 tokens,
the peak host bytes (``VmHWM`` of the process from /proc/self/status minus its
``VmRSS`` after the imports) when ready and after the first forward, the peak device
bytes (``torch.cuda.max_memory_allocated``; n/a on the CPU, where the compute device is
the host), and the ratios to the resident row: time (ready seconds) and host (peak after
the forward). On the CPU `transformers` leaves weights of the checkpoint's dtype as views
of the mmap'd files, read when first touched, so "ready" there reads little and the
first forward reads the rest: compare the peaks after the forward. The checkpoint's
pages are in the page cache (it was just written, or read by the first rep): these are
warm-cache numbers, not disk reads.

Run: ``python benchmarks/bench_load.py`` (about 40 s on a 2-core CPU machine; on CUDA
needs host memory for 2x the model and, for the resident row, device memory for it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

STATUS = Path("/proc/self/status")
MODES = ("resident", "prefetch", "uva")
TOKENS = 8
VOCAB = 8192
GB = 1e9


def status_bytes(field: str) -> int:
    """One ``kB`` field of /proc/self/status (``VmHWM``, ``VmRSS``), in bytes."""
    for line in STATUS.read_text().splitlines():
        key, _, value = line.partition(":")
        if key == field:
            return int(value.split()[0]) * 1024
    raise RuntimeError(f"{STATUS} has no {field}")


# ---- building the checkpoint ----------------------------------------------------------------


def build_checkpoint(directory: Path, *, size_bytes: int, hidden: int, dtype: torch.dtype) -> str:
    """Write a random Llama-shaped checkpoint of about `size_bytes`; a one-line description."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    itemsize = torch.empty((), dtype=dtype).element_size()
    inner = hidden * 11 // 4
    layer = (4 * hidden * hidden + 3 * hidden * inner) * itemsize
    outside = 2 * VOCAB * hidden * itemsize  # untied embeddings and head
    layers = max(2, round((size_bytes - outside) / layer))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    # transformers leaves from_config unannotated: go through Any.
    model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    nbytes: int = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size=f"{max(1, nbytes // 4 // 1_000_000)}MB")
    shards = len(list(directory.glob("*.safetensors")))
    return (f"random Llama-shaped, {layers} layers, width {hidden}, {str(dtype).removeprefix('torch.')}, "
            f"{nbytes / GB:.2f} GB in {shards} shards")


def build_whisper_checkpoint(directory: Path, *, size_bytes: int, hidden: int, dtype: torch.dtype) -> str:
    """Write a random Whisper-shaped checkpoint of about `size_bytes` (as many encoder as
    decoder layers); a one-line description."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    itemsize = torch.empty((), dtype=dtype).element_size()
    ffn = 4 * hidden
    pair = (4 * hidden * hidden + 2 * hidden * ffn + 4 * hidden * hidden + 2 * hidden * ffn + 4 * hidden * hidden) * itemsize
    layers = max(2, round(size_bytes / pair))
    config = WhisperConfig(vocab_size=VOCAB, num_mel_bins=80, encoder_layers=layers, decoder_layers=layers,
                           encoder_attention_heads=hidden // 64, decoder_attention_heads=hidden // 64,
                           encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, d_model=hidden, max_source_positions=64,
                           max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           decoder_start_token_id=1)
    torch.manual_seed(0)
    model: Any = WhisperForConditionalGeneration(config)
    model = model.to(dtype)
    nbytes: int = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(directory, max_shard_size=f"{max(1, nbytes // 4 // 1_000_000)}MB")
    shards = len(list(directory.glob("*.safetensors")))
    return (f"random Whisper-shaped, {layers} encoder and {layers} decoder layers, width {hidden}, "
            f"{str(dtype).removeprefix('torch.')}, {nbytes / GB:.2f} GB in {shards} shards")


def checkpoint_bytes(directory: Path) -> int:
    """The bytes of the checkpoint's tensors (headers read, no data)."""
    from offload.model.checkpoint import read_checkpoint

    found = read_checkpoint(directory)
    return found.spec.nbytes + found.outside_bytes


# ---- one measurement, in its own process --------------------------------------------------


def _layers_bytes(directory: Path) -> int:
    from offload.model.checkpoint import read_checkpoint

    return read_checkpoint(directory).spec.nbytes


#: ``--quantise`` schemes: the torchao config of each, by name (imported in the child only).
QUANTISE = ("none", "int8", "float8")


def _quantisation(scheme: str) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments quantising the checkpoint's linear layers as
    `scheme` says, through transformers' own torchao integration (`TorchAoConfig`)."""
    if scheme == "none":
        return {}
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    chosen = Int8WeightOnlyConfig() if scheme == "int8" else Float8WeightOnlyConfig()
    return {"quantization_config": TorchAoConfig(chosen)}


def measure(mode: str, directory: Path, scheme: str = "none") -> dict[str, Any]:
    """Load `directory` as `mode` says (quantised as `scheme` says), then one forward; the
    numbers of one row."""
    import transformers
    import transformers.modeling_utils  # noqa: F401  (imported before the clock: seconds of imports, not loading)

    from offload import OffloadConfig
    from offload.hf import load_on_host, offload_pretrained

    cuda = torch.cuda.is_available()
    # The model's own code, resolved (imported) before the clock: the class config.json names.
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    getattr(transformers, config.architectures[0])
    configs = {
        "prefetch": OffloadConfig(backend="prefetch", group_size=2, num_in_group=1, prefetch_step=2),
        "uva": OffloadConfig(backend="uva", uva_max_bytes=max(1, _layers_bytes(directory) // 2)),
    }
    quantised = _quantisation(scheme)  # torchao imported before the clock too
    base = status_bytes("VmRSS")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    report: dict[str, Any] = {"mode": mode, "fits": True}
    model: Any  # transformers' decorated `to` does not type-check with a device string
    start = time.perf_counter()
    if mode == "resident":
        model = load_on_host(directory, **quantised)
        if cuda:
            free, _ = torch.cuda.mem_get_info()
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            if nbytes < 0.9 * free:
                model.to("cuda")
            else:
                report["fits"] = False
    else:
        model, _ = offload_pretrained(directory, configs[mode], **quantised)
    if cuda:
        torch.cuda.synchronize()
    report["ready_s"] = time.perf_counter() - start
    report["host_ready"] = status_bytes("VmHWM") - base
    report["device_ready"] = torch.cuda.max_memory_allocated() if cuda else None
    device = next(model.parameters()).device if mode == "resident" else torch.device("cuda" if cuda else "cpu")
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0)).to(device)
    inputs: dict[str, torch.Tensor] = {"input_ids": ids}
    if getattr(config, "model_type", "") == "whisper":  # features for the encoder, token ids for the decoder
        features = torch.randn(1, config.num_mel_bins, 2 * config.max_source_positions,
                               generator=torch.Generator().manual_seed(0))
        inputs = {"input_features": features.to(device=device, dtype=next(model.parameters()).dtype),
                  "decoder_input_ids": ids}
    start = time.perf_counter()
    with torch.inference_mode():
        model(**inputs)
    if cuda:
        torch.cuda.synchronize()
    report["forward_s"] = time.perf_counter() - start
    report["host_forward"] = status_bytes("VmHWM") - base
    report["device_forward"] = torch.cuda.max_memory_allocated() if cuda else None
    return report


def run_child(mode: str, directory: Path, scheme: str = "none") -> dict[str, Any]:
    """`measure` in a fresh interpreter; its JSON report."""
    done = subprocess.run([sys.executable, __file__, "--child", mode, str(directory), scheme], capture_output=True,
                          text=True, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"bench_load: the {mode} measurement failed:\n{done.stderr}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


# ---- the table ---------------------------------------------------------------------------------


def _mib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


def summarize(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the reps of one row."""
    def median(key: str) -> float | None:
        values = [r[key] for r in reports if r[key] is not None]
        return statistics.median(values) if values else None

    keys = ("ready_s", "forward_s", "host_ready", "host_forward", "device_ready", "device_forward")
    return {"fits": all(r["fits"] for r in reports), **{key: median(key) for key in keys}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--checkpoint", type=Path, help="measure this checkpoint directory instead of building one")
    parser.add_argument("--model", choices=("llama", "whisper"), default="llama",
                        help="the checkpoint to build: one stack (llama, default) or two (whisper)")
    parser.add_argument("--size-gb", type=float, help="size of the built checkpoint (default 0.2 on CPU, 4 on CUDA)")
    parser.add_argument("--reps", type=int, default=2, help="measurements per row, each a fresh process (default 2)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="rows (default all)")
    parser.add_argument("--quantise", choices=QUANTISE, default="none",
                        help="quantise the linear layers at load with torchao through transformers' TorchAoConfig, "
                             "every row alike (default none; needs the quant extra)")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "DIR", "SCHEME"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not STATUS.is_file():
        print(f"bench_load: {STATUS} is missing; peak host memory (VmHWM) cannot be read here. Nothing measured.")
        return 1
    if args.child:
        print(json.dumps(measure(args.child[0], Path(args.child[1]), args.child[2])))
        return 0
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    import transformers

    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="bench_load-") as scratch:
        if args.checkpoint is not None:
            directory = args.checkpoint
            described = "given"
        else:
            directory = Path(scratch) / args.model
            size = args.size_gb if args.size_gb is not None else (4.0 if cuda else 0.2)
            build = build_whisper_checkpoint if args.model == "whisper" else build_checkpoint
            described = build(directory, size_bytes=round(size * GB), hidden=4096 if cuda else 768,
                              dtype=torch.bfloat16 if cuda else torch.float32)
        total = checkpoint_bytes(directory)
        where = f"CUDA {torch.cuda.get_device_name()}" if cuda else "CPU (no CUDA: the compute device is the host)"
        print(f"bench_load: {where}, torch {torch.__version__}, transformers {transformers.__version__}")
        print(f"checkpoint: {directory} ({described}; {total / GB:.3f} GB of tensors), warm page cache")
        print(f"each measurement a fresh process, medians of {args.reps}; host peak = VmHWM minus VmRSS after imports; "
              "ratios to resident: time of ready, host peak after the forward")
        if args.quantise != "none":
            print(f"quantised at load: {args.quantise} weight-only (torchao through TorchAoConfig), every row")
        rows = {mode: summarize([run_child(mode, directory, args.quantise) for _ in range(args.reps)])
                for mode in args.modes}
    header = (f"{'mode':<9} {'ready s':>8} {'GB/s':>6} {'fwd s':>6} {'host ready':>11} {'host +fwd':>10} "
              f"{'dev ready':>10} {'dev +fwd':>10} {'time x':>7} {'host x':>7}")
    print(header)
    base = rows.get("resident")
    for mode, row in rows.items():
        time_ratio = f"{row['ready_s'] / base['ready_s']:.2f}" if base else "-"
        host_ratio = f"{row['host_forward'] / base['host_forward']:.2f}" if base else "-"
        note = "" if row["fits"] else "  (does not fit on the device: loaded on the host only)"
        print(f"{mode:<9} {row['ready_s']:>8.2f} {total / row['ready_s'] / GB:>6.2f} {row['forward_s']:>6.2f} "
              f"{_mib(row['host_ready']):>11} {_mib(row['host_forward']):>10} {_mib(row['device_ready']):>10} "
              f"{_mib(row['device_forward']):>10} {time_ratio:>7} {host_ratio:>7}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
