"""Routed-expert (MoE) computation: token grouping, gate/up GEMM + SwiGLU, down GEMM, weighted combine."""
from kernels.moe.api import ExpertWeights, moe_experts

__all__ = ["ExpertWeights", "moe_experts"]
