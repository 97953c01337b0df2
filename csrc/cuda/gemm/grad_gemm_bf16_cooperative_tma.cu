// The gradient GEMM for bf16 inputs, cooperative schedule (128 x 256 tiles), gradient stored through shared memory by TMA
// (grad_tma_gemm.cuh; the register epilogue has no cooperative instantiation).
#include "grad_tma_gemm.cuh"

HUGEHEAD_GRAD_TMA_GEMM_INSTANCE(grad_gemm_bf16_cooperative_tma, cutlass::bfloat16_t, hugehead::gemm::Schedule::kCooperative)
