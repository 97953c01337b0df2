// The statistics GEMM that stores its logits for fp16 inputs, pingpong on 128 x 192 tiles in 2-CTA clusters: fold_pairs()
// writes z back into the accumulators, which CUTLASS's TMA epilogue then stores (see stats_store_gemm.cuh).
#include "stats_store_gemm.cuh"

HUGEHEAD_STATS_STORE_GEMM_INSTANCE(stats_gemm_store_fp16_pingpong_cluster192, cutlass::half_t, hugehead::gemm::Schedule::kPingpongCluster192)
