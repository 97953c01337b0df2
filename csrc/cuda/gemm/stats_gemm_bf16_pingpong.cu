// The statistics GEMM for bf16 inputs, pingpong schedule (see stats_gemm.cuh).
#include "stats_gemm.cuh"

HUGEHEAD_STATS_GEMM_INSTANCE(stats_gemm_bf16_pingpong, cutlass::bfloat16_t, hugehead::gemm::Schedule::kPingpong)
