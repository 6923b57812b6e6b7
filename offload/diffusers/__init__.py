"""Diffusers pipelines offloaded in one call (the ``diffusers`` extra; `import offload`
never imports this package, and this package imports diffusers only to check its input).

- `offload_pipeline(pipe, ...)`: every component's layer stacks (the text encoders', the
  transformer's double and single blocks, the VAE's) planned against one device budget,
  each prefetched on its own; everything else of every component on the device;
  ``restore()`` gives all of it back.

A diffusers *model* (a transformer or UNet alone) needs nothing here: `offload.hf.offload_model`
takes it, and `offload.hf.offload_pretrained` loads one from its directory (the class from
``config.json``'s ``_class_name``).
"""

from offload.diffusers.pipeline import offload_pipeline, pipeline_components

__all__ = ["offload_pipeline", "pipeline_components"]
