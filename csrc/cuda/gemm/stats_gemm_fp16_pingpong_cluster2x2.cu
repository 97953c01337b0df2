// The statistics GEMM for fp16 inputs, pingpong schedule in 2 x 2 clusters (see stats_gemm.cuh).
#include "stats_gemm.cuh"

HUGEHEAD_STATS_GEMM_INSTANCE(stats_gemm_fp16_pingpong_cluster2x2, cutlass::half_t, hugehead::gemm::Schedule::kPingpongCluster2x2)
