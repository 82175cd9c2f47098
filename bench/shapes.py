"""Benchmark shapes as data: named model configs shared by the benchmark, the tuning sweep, the
ROCm compile gate and the benchmark's quick test."""

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

# Which configs each op is measured on by default (the first is the headline one).
OP_CONFIGS = {
    "fused_q_kv_rmsnorm": ("deepseek-v3-mla",),
    "rmsnorm": ("deepseek-v3-mla",),  # the q latent, 1536 wide
    "rmsnorm_gated": ("kimi-linear-kda", "kimi-k3-kda-tp8"),
    "rmsnorm_gated_fp8_per_token": ("kimi-linear-kda", "kimi-k3-kda-tp8", "kimi-k3-kda"),
    "per_token_fp8_quant": ("kimi-linear-kda",),  # the o_proj input, H*D wide
    # Integration paths: the packed MLA projection; the KDA output path with its FP8 o_proj.
    "mla_q_kv_norm": ("deepseek-v3-mla",),
    "kda_output_fp8": ("kimi-k3-kda-tp8", "kimi-k3-kda"),
}
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
