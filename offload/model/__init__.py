"""What a model is, read from the shell: live modules (`describe`: `describe_layers`, storage
identities for ties) and checkpoint files (`checkpoint`: safetensors headers,
`spec_from_checkpoint`, `read_checkpoint`), each to a `offload.pure.spec.values.ModelSpec`."""
