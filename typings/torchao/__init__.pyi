# Stub for torchao 0.18.0 (the package ships no type information): only what offload's
# tests use. Signatures from torchao/quantization/quant_api.py of that release.
