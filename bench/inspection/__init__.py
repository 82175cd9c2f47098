"""Looking inside what XLA and the GPU make of the kernels: HLO reports, register counts, profiler
cases, trace samples, the sharded path on the local GPUs."""
