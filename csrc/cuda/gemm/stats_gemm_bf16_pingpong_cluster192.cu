// The statistics GEMM for bf16 inputs on 128 x 192 tiles, pingpong schedule in 2-CTA clusters (see stats_gemm.cuh:
// this tile has fold_pairs() only, no softcap and no stored logits).
#include "stats_gemm.cuh"

HUGEHEAD_STATS_GEMM_INSTANCE(stats_gemm_bf16_pingpong_cluster192, cutlass::bfloat16_t, hugehead::gemm::Schedule::kPingpongCluster192)
