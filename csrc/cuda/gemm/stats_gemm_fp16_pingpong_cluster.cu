// The statistics GEMM for fp16 inputs, pingpong schedule in 2-CTA clusters (see stats_gemm.cuh).
#include "stats_gemm.cuh"

HUGEHEAD_STATS_GEMM_INSTANCE(stats_gemm_fp16_pingpong_cluster, cutlass::half_t, hugehead::gemm::Schedule::kPingpongCluster)
