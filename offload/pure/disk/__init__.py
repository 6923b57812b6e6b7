"""The disk tier, planned: which offloaded layers live on disk rather than in host memory,
where each of their bytes is read from, and the ring of host staging buffers the reads
fill ahead of the copies (`tier`), and how that reads for people (`render`).

It reads a prefetch `OffloadPlan` and the checkpoint's extents (`offload.pure.spec.extents`)
and imports nothing else of the core's rooms but `spec` and `plan`. The prefetch executor
runs it (`offload.executors.prefetch`, Note [disk tier]); ``offload plan --host-gib`` shows it.
"""
