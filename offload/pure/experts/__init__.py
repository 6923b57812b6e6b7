"""Mixture-of-experts layers served expert by expert: the device expert cache each MoE
layer gets (`values`: `ExpertCachePlan`), the policy that decides its hits, misses and
evictions (`policy`), routing profiles and traces (`values`), a profile's checks, held
experts and JSON (`profile`), a trace's replay, Belady's optimum and Zipf traces
(`replay`), the cache's size from a device budget (`size`), and their rendering
(`render`).

It imports only `spec` (`offload.pure.spec.experts.ExpertGroup`, what a MoE layer holds)
and the core's shared helpers; the plan holds its values (`OffloadPlan.experts`) and the
expert executor (`offload.executors.experts`) runs them, asking `policy` at every call
which slot each routed expert comes from.
"""
