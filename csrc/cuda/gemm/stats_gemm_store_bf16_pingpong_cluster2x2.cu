// The statistics GEMM that stores its logits for bf16 inputs, pingpong schedule in 2 x 2 clusters (see stats_store_gemm.cuh).
#include "stats_store_gemm.cuh"

HUGEHEAD_STATS_STORE_GEMM_INSTANCE(stats_gemm_store_bf16_pingpong_cluster2x2, cutlass::bfloat16_t, hugehead::gemm::Schedule::kPingpongCluster2x2)
