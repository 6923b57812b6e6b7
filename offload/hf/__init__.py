"""Hugging Face integration: a `transformers` model offloaded in one call.

- `find_stacks(model)`: the model's layer stacks (an encoder and a decoder, a vision
  tower and a language model), found by structure; `find_layers(model)`: one of them.
- `offload_model(model, ...)`: plan every stack against one budget (a config, or `fit`
  for a device budget), wrap, `post_init`; the weights outside the layers go to the device.
- `offload_pretrained(path, ...)`: a local checkpoint loaded into host memory by
  `transformers` (or `diffusers`, for a diffusers model) as the class that was saved, and
  offloaded, never materialised whole on the device.
- `checkpoint_buffers(path)`: which tensors of a checkpoint the model holds as buffers
  (its class built on meta), so that a plan from the headers does not offload them.

`find_stacks`, `find_layers` and `offload_model` work on any `nn.Module`; only
`offload_pretrained` and `checkpoint_buffers` need `transformers` (``pip install
'offload[hf]'``; `diffusers` for a diffusers checkpoint), imported when they are called.
`import offload` never imports this package.
"""

from offload.hf.buffers import BufferNames, checkpoint_buffers
from offload.hf.layers import StackCandidate, find_layers, find_stacks, layer_stacks
from offload.hf.model import ModelOffloader, offload_model, plan_model
from offload.hf.pretrained import load_on_host, offload_pretrained

__all__ = [
    "BufferNames",
    "ModelOffloader",
    "StackCandidate",
    "checkpoint_buffers",
    "find_layers",
    "find_stacks",
    "layer_stacks",
    "load_on_host",
    "offload_model",
    "offload_pretrained",
    "plan_model",
]
