// The gradient GEMM for bf16 inputs, pingpong_cluster schedule, gradient stored through shared memory by TMA (grad_tma_gemm.cuh).
#include "grad_tma_gemm.cuh"

HUGEHEAD_GRAD_TMA_GEMM_INSTANCE(grad_gemm_bf16_pingpong_cluster_tma, cutlass::bfloat16_t, hugehead::gemm::Schedule::kPingpongCluster)
