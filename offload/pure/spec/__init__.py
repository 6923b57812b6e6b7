"""What a model is, as values: `ParamSpec`, `LayerSpec`, `ModelSpec` (`values`), the
preset shapes of well-known models (`presets`), and what a safetensors header says
(`safetensors`: the header, the layer stacks of a checkpoint)."""
