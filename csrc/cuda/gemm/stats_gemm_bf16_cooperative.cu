// The statistics GEMM for bf16 inputs, cooperative schedule (see stats_gemm.cuh).
#include "stats_gemm.cuh"

HUGEHEAD_STATS_GEMM_INSTANCE(stats_gemm_bf16_cooperative, cutlass::bfloat16_t, hugehead::gemm::Schedule::kCooperative)
