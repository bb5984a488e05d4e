"""The runtime: validate, plan, stage, replay, split (:mod:`.encoder`), the coalescing front
(:mod:`.coalesce`), the plan cache, the options and tuning an encoder holds, and the kernel
precompile. It knows towers only by their contract (:mod:`vitgraph.engine.contract`)."""
