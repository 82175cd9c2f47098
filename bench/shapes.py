"""Benchmark token counts, and the model configs of the integration paths that are not ops (each
op's own shapes are in the op table, ``k3pallas.ops``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    name: str
    q_lora_rank: int
    kv_lora_rank: int
    eps: float = 1e-6
    rope_dim: int = 64  # the k_pe columns of the packed projection


@dataclasses.dataclass(frozen=True)
class KDAConfig:
    name: str
    heads: int
    head_dim: int
    eps: float = 1e-5
    hidden: int = 7168  # o_proj output width: Kimi-K3's hidden size (used by kda_output_fp8)


MLA = {
    # DeepSeek-V3, Kimi-K2 and Kimi-K3 share the MLA latent sizes.
    "deepseek-v3-mla": MLAConfig("deepseek-v3-mla", 1536, 512),
}
KDA = {
    "kimi-linear-kda": KDAConfig("kimi-linear-kda", 32, 128),
    "kimi-k3-kda-tp8": KDAConfig("kimi-k3-kda-tp8", 12, 128),  # 96 heads over 8 ranks
    "kimi-k3-kda": KDAConfig("kimi-k3-kda", 96, 128),
}

DEFAULT_TOKENS = (1, 7, 64, 512, 4096, 16384, 65536)
QUICK_TOKENS = (1, 64)


def _op_configs() -> dict:
    """Each op's model configs (the op table, ``k3pallas.ops``; headline first), then the
    integration paths that are not ops."""
    from bench import cases as ops

    configs = {name: op.configs for name, op in ops.OPS.items()}
    # The KDA output path with its FP8 o_proj (bench.ops.make_case).
    configs["kda_output_fp8"] = ("kimi-k3-kda-tp8", "kimi-k3-kda")
    return configs


OP_CONFIGS = _op_configs()
OPS = tuple(OP_CONFIGS)
# Default token counts where an op differs from DEFAULT_TOKENS: the KDA output path is bound by
# its o_proj GEMM from a few thousand tokens on (and its large-T cases take minutes to autotune
# and time), so the benchmark stops at 4096 there.
OP_TOKENS = {"kda_output_fp8": (1, 7, 64, 512, 4096)}
# Paths whose only Pallas kernel is another op's (the ROCm compile gate skips them).
NO_KERNEL_OF_ITS_OWN = ("kda_output_fp8",)


def config(name: str):
    if name in MLA:
        return MLA[name]
    if name in KDA:
        return KDA[name]
    raise KeyError(f"unknown model config {name!r}; known: {sorted(MLA) + sorted(KDA)}")
