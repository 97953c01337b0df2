// The gradient GEMM for fp16 inputs, pingpong schedule (see grad_gemm.cuh).
#include "grad_gemm.cuh"

HUGEHEAD_GRAD_GEMM_INSTANCE(grad_gemm_fp16, cutlass::half_t)
