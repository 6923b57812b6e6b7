# Stub for torchao 0.18.0, torchao.quantization: the configs and `quantize_` offload's
# tests use. Signatures from torchao/quantization/quant_api.py of that release (the
# configs are dataclasses whose fields all have defaults; only the no-argument form is
# declared here).
from collections.abc import Callable

from torch import nn

class AOBaseConfig: ...
class Int8WeightOnlyConfig(AOBaseConfig):
    def __init__(self) -> None: ...
class Int8DynamicActivationInt8WeightConfig(AOBaseConfig):
    def __init__(self) -> None: ...
class Float8WeightOnlyConfig(AOBaseConfig):
    def __init__(self) -> None: ...
class IntxWeightOnlyConfig(AOBaseConfig):
    def __init__(self) -> None: ...

def quantize_(
    model: nn.Module,
    config: AOBaseConfig,
    filter_fn: Callable[[nn.Module, str], bool] | None = ...,
    device: str | None = ...,
) -> None: ...
