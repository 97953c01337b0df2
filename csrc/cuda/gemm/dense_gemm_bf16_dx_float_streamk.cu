// The dense backward GEMM dX += g W_c, float32 out, bf16 inputs, stream-K (see dense_gemm.cuh).
#include "dense_gemm.cuh"

HUGEHEAD_DENSE_GEMM_INSTANCE(dense_gemm_bf16_dx_float_streamk, cutlass::bfloat16_t, hugehead::gemm::DenseKind::kDx, hugehead::gemm::DenseConfig::kStreamK,
                             float, float)
