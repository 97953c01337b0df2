// The statistics GEMM that stores its logits for fp16 inputs, pingpong schedule in 2 x 2 clusters (see stats_store_gemm.cuh).
#include "stats_store_gemm.cuh"

HUGEHEAD_STATS_STORE_GEMM_INSTANCE(stats_gemm_store_fp16_pingpong_cluster2x2, cutlass::half_t, hugehead::gemm::Schedule::kPingpongCluster2x2)
