// The statistics GEMM of a kept chunk against the running row max for bf16 inputs that stores exp(z - ref) (the
// chunk's probabilities up to each row's scale) in place of z, for the loop's factored backward; pingpong on
// 128 x 192 tiles in 2-CTA clusters (see stats_ref_gemm.cuh).
#include "stats_ref_gemm.cuh"

HUGEHEAD_STATS_REF_GEMM_INSTANCE(stats_gemm_probs_bf16_pingpong_cluster192, cutlass::bfloat16_t, hugehead::gemm::Schedule::kPingpongCluster192, true)
