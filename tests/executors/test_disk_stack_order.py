"""The disk tier reads only what the steps use on an encoder and a decoder: the staging
ring stages each buffer's next occupant in the order the stacks actually run (an encoder
once per request, then its decoder once per token), not each stack's own next run. Reads
are counted per layer as they are submitted (a reader that records them), per request and
per token."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from offload.executors.prefetch.disk import DiskIO
from offload.pure.config import OffloadConfig
from offload.runtime.cpu import CpuRuntime
from offload.runtime.diskio import Destination, DiskReader, ReadHandle, Source
from tests.executors.disk_helpers import plan_tier, wrap

ENCODER_LAYERS = DECODER_LAYERS = 4


class CountingReader:
    """A `DiskReader` (wrapped: the class is final) that records each request it is given
    (source, offset, bytes) before passing it on."""

    def __init__(self, record: list[tuple[Source, int, int]]) -> None:
        self._inner = DiskReader()
        self._record = record

    def submit(self, source: Source, offset: int, length: int, dest: Destination, *,
               before: Callable[[], object] | None = None) -> ReadHandle:
        self._record.append((source, offset, length))
        return self._inner.submit(source, offset, length, dest, before=before)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # close, stats: the reader's own


def _whisper() -> Any:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=96, num_mel_bins=8, encoder_layers=ENCODER_LAYERS,
                           decoder_layers=DECODER_LAYERS, encoder_attention_heads=4, decoder_attention_heads=4,
                           encoder_ffn_dim=512, decoder_ffn_dim=512, d_model=128, max_source_positions=16,
                           max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           decoder_start_token_id=1)
    torch.manual_seed(0)
    made: Any = WhisperForConditionalGeneration(config)
    return made.eval()


def test_a_request_reads_each_encoder_layer_once_and_a_token_each_decoder_layer_once(tmp_path: Path) -> None:
    model, reference = _whisper(), _whisper()
    plan, tier, layers = plan_tier(model, None, read_ahead=2, config=OffloadConfig(group_size=1, prefetch_step=1),
                                   disk_layers=ENCODER_LAYERS + DECODER_LAYERS)
    record: list[tuple[Source, int, int]] = []
    offloader = wrap(model, layers, plan, tier, CpuRuntime(), tmp_path, DiskIO(reader=lambda: cast(DiskReader, CountingReader(record))))
    # Which layer each request reads: every disk parameter lies at (file, offset) in the spill file.
    disk: Any = offloader.inner
    where = [(source, at, at + p.nbytes, p.layer) for p in tier.params
             for source, at in [disk._disk.host.sources[(p.layer, p.name)]]]

    def layer_of(source: Source, offset: int) -> int:
        return next(layer for s, start, stop, layer in where if s == source and start <= offset < stop)

    def reads_since(mark: int) -> Counter[str]:
        """Layer reads among the requests since `mark`, by stack: a layer's read is its run
        of consecutive requests (the ring submits one layer's at a time)."""
        found: Counter[str] = Counter()
        current: tuple[int, set[tuple[Source, int]]] | None = None
        for source, offset, _ in record[mark:]:
            layer = layer_of(source, offset)
            if current is None or current[0] != layer or (source, offset) in current[1]:
                current = (layer, set())
                found["encoder" if layer < ENCODER_LAYERS else "decoder"] += 1
            current[1].add((source, offset))
        return found

    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))
    requests, tokens = 3, 4
    encoder_reads, token_reads = [], []
    with torch.inference_mode():
        for _ in range(requests):
            mark = len(record)
            encoded = model.model.encoder(features).last_hidden_state
            assert torch.equal(encoded, reference.model.encoder(features).last_hidden_state)
            ids = torch.ones(2, 1, dtype=torch.long)
            for token in range(tokens):
                logits = model(encoder_outputs=(encoded,), decoder_input_ids=ids).logits
                assert torch.equal(logits, reference(encoder_outputs=(encoded,), decoder_input_ids=ids).logits)
                if token == 0:
                    encoder_reads.append(reads_since(mark)["encoder"])
                else:
                    token_reads.append(reads_since(mark)["decoder"])
                mark = len(record)
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    # After the first request (which also reads what post_init staged), each request reads
    # each encoder layer once: its run, and the copy of its first layer for the next request.
    assert encoder_reads[1:] == [ENCODER_LAYERS] * (requests - 1), encoder_reads
    # Each token after a request's first reads each decoder layer once, staged ahead.
    assert token_reads == [DECODER_LAYERS] * (requests * (tokens - 1)), token_reads
    stats = offloader.stats()
    assert stats.realignments == 0
    assert stats.disk_misses <= 2 * requests, stats.disk_misses  # only at the switches between the stacks
    offloader.restore()
