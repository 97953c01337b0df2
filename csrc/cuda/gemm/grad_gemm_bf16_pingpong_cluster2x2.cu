// The gradient GEMM for bf16 inputs, pingpong schedule in 2 x 2 clusters (see grad_gemm.cuh).
#include "grad_gemm.cuh"

HUGEHEAD_GRAD_GEMM_INSTANCE(grad_gemm_bf16_pingpong_cluster2x2, cutlass::bfloat16_t, hugehead::gemm::Schedule::kPingpongCluster2x2)
