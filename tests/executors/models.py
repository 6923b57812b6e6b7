"""Small real `nn.Module` blocks for the executor tests, and the post-processing steps
that loaders apply to them after `wrap_modules`.

Every block computes with ordinary PyTorch ops, so the offloaded model and a resident deep
copy run exactly the same kernels on the same values: outputs must be equal bit for bit.
Post-processing steps are deterministic functions of the current weights, so applying one
to the offloaded model and to its resident copy gives the same new weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "HIDDEN",
    "Attention",
    "BroadcastScaleBlock",
    "BufferBlock",
    "Float8Linear",
    "FusedBlock",
    "Int8Linear",
    "Mlp",
    "OptionalParamBlock",
    "ProbeBlock",
    "SharedStorageBlock",
    "SlicedBlock",
    "TiedBlock",
    "TransformerBlock",
    "TransposedBlock",
    "bits",
    "drop_extra_by_del",
    "drop_extra_by_none",
    "layer_list",
    "make_weight_t_contiguous",
    "mixed_model",
    "replace_scale_with_scalar",
    "replace_up_weight_data",
    "replace_up_weight_parameter",
    "scale_weights_in_place",
    "transformer_model",
    "widen_float8_weight",
]

#: Hidden size of the CPU test models: small enough that a forward is microseconds.
HIDDEN = 16


class Mlp(nn.Module):
    """LayerNorm, up projection, GELU, down projection, residual."""

    def __init__(self, hidden: int = HIDDEN, inner: int = 4 * HIDDEN, *, bias: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, inner, bias=bias)
        self.down = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm(x))))
        return out


class Attention(nn.Module):
    """Pre-norm multi-head self-attention with a fused qkv projection, residual."""

    def __init__(self, hidden: int = HIDDEN, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, tokens, self.heads, hidden // self.heads).transpose(1, 2)

        mixed = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        out: torch.Tensor = x + self.out(mixed.transpose(1, 2).reshape(batch, tokens, hidden))
        return out


class TransformerBlock(nn.Module):
    """Attention then MLP: names like ``attn.qkv.weight`` and ``mlp.up.bias``."""

    def __init__(self, hidden: int = HIDDEN, inner: int | None = None, heads: int = 2) -> None:
        super().__init__()
        self.attn = Attention(hidden, heads)
        self.mlp = Mlp(hidden, 4 * hidden if inner is None else inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.attn(x))
        return out


class TransposedBlock(nn.Module):
    """A linear layer whose weight is a transposed (non-contiguous) view, as checkpoints
    stored in (in, out) order give it: shape (out, in), stride (1, out)."""

    def __init__(self, hidden: int = HIDDEN, inner: int = 3 * HIDDEN) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, inner) / hidden**0.5)
        self.weight_t = nn.Parameter(torch.randn(hidden, inner).t())  # (inner, hidden), stride (1, inner)
        self.bias = nn.Parameter(torch.randn(inner))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(F.relu(F.linear(x, self.weight_t, self.bias)), self.weight)


class SlicedBlock(nn.Module):
    """A linear layer whose weight is every other column of a larger tensor, as a loader
    that slices a fused checkpoint tensor gives it: its strides leave gaps, shape
    (hidden, hidden), stride (2 * hidden, 2)."""

    def __init__(self, hidden: int = HIDDEN, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # Made in its dtype: `Module.to(dtype)` would make a weight with gaps contiguous.
        self.weight = nn.Parameter((torch.randn(hidden, 2 * hidden) / hidden**0.5).to(dtype)[:, ::2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(x, self.weight)


class Int8Linear(nn.Module):
    """An int8 weight with a per-row float scale, used through a dequantising forward."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.qweight = nn.Parameter(torch.randint(-127, 128, (hidden, hidden), dtype=torch.int8),
                                    requires_grad=False)
        self.scale = nn.Parameter(torch.rand(hidden) / (64 * hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(x, self.qweight.to(x.dtype) * self.scale[:, None])


class Float8Linear(nn.Module):
    """A float8_e4m3fn weight with a scalar scale, used through a dequantising forward."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fweight = nn.Parameter(torch.randn(hidden, hidden).to(torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(torch.tensor([0.25]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(x, self.fweight.to(x.dtype) * self.scale)


class TiedBlock(nn.Module):
    """Two linear layers tied to one Parameter object: ``a.weight`` is ``b.weight``."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.a = nn.Linear(hidden, hidden, bias=False)
        self.b = nn.Linear(hidden, hidden)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.b(torch.tanh(self.a(x)))
        return out


class FusedBlock(nn.Module):
    """Two parameters that are different views (slices) of one storage, as a fused weight
    split into q and k is."""

    def __init__(self) -> None:
        super().__init__()
        fused = torch.randn(2 * 16, 16)
        self.q = nn.Parameter(fused[:16])
        self.k = nn.Parameter(fused[16:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.q.T + x @ self.k.T


class BufferBlock(nn.Module):
    """A linear layer and a persistent buffer (``shift``) it adds: a state dict has both."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.register_buffer("shift", torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x)) + self.get_buffer("shift")


class SharedStorageBlock(nn.Module):
    """Two distinct Parameter objects over one storage (what ``p.data = q.data`` leaves)."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        weight = torch.randn(hidden, hidden) / hidden**0.5
        self.first = nn.Parameter(weight)
        self.second = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.linear(torch.tanh(F.linear(x, self.first)), self.second)


class OptionalParamBlock(nn.Module):
    """An MLP with an optional ``extra`` bias that post-processing may delete."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.mlp = Mlp(hidden)
        self.extra = nn.Parameter(torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = getattr(self, "extra", None)
        y: torch.Tensor = self.mlp(x)
        return y if extra is None else y + extra


class BroadcastScaleBlock(nn.Module):
    """An MLP followed by a ``scale`` of shape (hidden,), which post-processing may replace
    by a tensor of another shape that still broadcasts (shape (1,))."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.mlp = Mlp(hidden)
        self.scale = nn.Parameter(1 + torch.rand(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(x) * self.scale
        return out


class ProbeBlock(nn.Module):
    """A block that reports, as it computes, the data pointer of every parameter it reads
    (``on_read(qualified name, data_ptr)``), so a test can line reads up with copies."""

    def __init__(self, tag: str, on_read: Callable[[str, int], None], hidden: int = HIDDEN) -> None:
        super().__init__()
        self.tag = tag
        self.on_read = on_read
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, param in self.named_parameters():
            self.on_read(f"{self.tag}.{name}", param.data_ptr())
        out: torch.Tensor = x + self.down(F.relu(self.up(x)))
        return out


# ---- model builders -----------------------------------------------------------------


def transformer_model(num_layers: int, *, seed: int = 0, hidden: int = HIDDEN) -> nn.Sequential:
    """`num_layers` TransformerBlocks, deterministic for a seed."""
    torch.manual_seed(seed)
    return nn.Sequential(*[TransformerBlock(hidden) for _ in range(num_layers)])


def mixed_model(*, seed: int = 0) -> nn.Sequential:
    """One of each special block, between transformer blocks (10 layers)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        TransformerBlock(),
        TransposedBlock(),
        Int8Linear(),
        Float8Linear(),
        TiedBlock(),
        SharedStorageBlock(),
        OptionalParamBlock(),
        BroadcastScaleBlock(),
        TransformerBlock(),
        Mlp(),
    )


# ---- post-processing steps (each takes one layer) -------------------------------------


def replace_up_weight_data(layer: nn.Module) -> None:
    """``param.data = new tensor`` (same Parameter object, same shape, new values)."""
    up = layer.get_submodule("mlp.up")
    assert isinstance(up, nn.Linear)
    up.weight.data = torch.round(up.weight.data * 8) / 8


def replace_up_weight_parameter(layer: nn.Module) -> None:
    """A new Parameter object under the old name (same shape, new values)."""
    up = layer.get_submodule("mlp.up")
    assert isinstance(up, nn.Linear)
    up.weight = nn.Parameter(up.weight.detach().flip(0).clone())


def scale_weights_in_place(layer: nn.Module) -> None:
    """Change values in place: the data object and its storage stay the same."""
    with torch.no_grad():
        for param in layer.parameters():
            if param.is_floating_point():
                param.mul_(0.5)


def widen_float8_weight(layer: nn.Module) -> None:
    """Dequantise ahead of time: the float8 weight becomes float32 (a new dtype)."""
    assert isinstance(layer, Float8Linear)
    layer.fweight = nn.Parameter(layer.fweight.detach().to(torch.float32), requires_grad=False)


def make_weight_t_contiguous(layer: nn.Module) -> None:
    """Repack the transposed weight row-major: same shape and values, new strides."""
    assert isinstance(layer, TransposedBlock)
    layer.weight_t.data = layer.weight_t.data.contiguous()


def replace_scale_with_scalar(layer: nn.Module) -> None:
    """Replace ``scale`` (hidden,) by its mean, shape (1,): another shape that broadcasts."""
    assert isinstance(layer, BroadcastScaleBlock)
    layer.scale = nn.Parameter(layer.scale.detach().mean().reshape(1))


def drop_extra_by_del(layer: nn.Module) -> None:
    """Delete the optional parameter outright."""
    assert isinstance(layer, OptionalParamBlock)
    del layer.extra


def drop_extra_by_none(layer: nn.Module) -> None:
    """Delete the optional parameter the way ``register_parameter(name, None)`` does."""
    assert isinstance(layer, OptionalParamBlock)
    layer.register_parameter("extra", None)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` reinterpreted as integers of the same width (strides kept), so that
    `torch.equal` compares bits: NaNs, -0.0 and float8 values included."""
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.detach().view(as_int)


def layer_list(model: nn.Module) -> Sequence[nn.Module]:
    """The layers of a Sequential model, as `describe_layers` and `wrap_modules` take them."""
    return list(model.children())
