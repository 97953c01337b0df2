// The statistics GEMM of a kept chunk against the running row max for fp16 inputs, pingpong on 128 x 192 tiles in
// 2-CTA clusters: the logits stored through CUTLASS's TMA epilogue, folded on the way (see stats_ref_gemm.cuh).
#include "stats_ref_gemm.cuh"

HUGEHEAD_STATS_REF_GEMM_INSTANCE(stats_gemm_ref_fp16_pingpong_cluster192, cutlass::half_t, hugehead::gemm::Schedule::kPingpongCluster192, false)
