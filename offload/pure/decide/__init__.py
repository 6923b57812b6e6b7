"""One module per decision, each a pure function of values: whether to pin host memory and
how (`pinning`), whether UVA views are on (`uva`), which parameters to offload
(`selection`), how each weight reaches its place (`moves`), where host copies live on a
NUMA host (`numa`), and whether the host memory fits (`admission`)."""
