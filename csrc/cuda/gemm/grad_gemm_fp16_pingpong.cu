// The gradient GEMM for fp16 inputs, pingpong schedule (see grad_gemm.cuh).
#include "grad_gemm.cuh"

HUGEHEAD_GRAD_GEMM_INSTANCE(grad_gemm_fp16_pingpong, cutlass::half_t, hugehead::gemm::Schedule::kPingpong)
