// The statistics GEMM for bf16 inputs, pingpong schedule in 2 x 2 clusters (see stats_gemm.cuh).
#include "stats_gemm.cuh"

HUGEHEAD_STATS_GEMM_INSTANCE(stats_gemm_bf16_pingpong_cluster2x2, cutlass::bfloat16_t, hugehead::gemm::Schedule::kPingpongCluster2x2)
