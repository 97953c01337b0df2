// The gradient GEMM for bf16 inputs, pingpong on 128 x 192 tiles in 2-CTA clusters, gradient stored through shared
// memory by TMA in 64 x 64 subtiles (tma_store_gemm.cuh's WideEpiTile).
#include "grad_tma_gemm.cuh"

HUGEHEAD_GRAD_TMA_GEMM_WIDE_INSTANCE(grad_gemm_bf16_pingpong_cluster192_tma_e64, cutlass::bfloat16_t, hugehead::gemm::Schedule::kPingpongCluster192)
