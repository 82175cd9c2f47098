"""The ROCm compile gate on XLA's own ROCm compiler (``check``), its environment (``env``), its
per-arch worker (``xla``) and the AMD time estimate built on it (``amd_cost``)."""
