"""The plan: its parts (`values`), the plan itself and its rules (`plan`, `_rules`), the
prefetch schedule (`schedule`), the static buffers and layer blocks (`layout`, `blocks`),
how it is made and revised (`make`, `revise`), its warnings (`warn`) and its text
(`render`)."""
