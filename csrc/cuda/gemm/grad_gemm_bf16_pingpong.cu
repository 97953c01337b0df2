// The gradient GEMM for bf16 inputs, pingpong schedule (see grad_gemm.cuh).
#include "grad_gemm.cuh"

HUGEHEAD_GRAD_GEMM_INSTANCE(grad_gemm_bf16_pingpong, cutlass::bfloat16_t, hugehead::gemm::Schedule::kPingpong)
