// The dense backward GEMM dW = g^T x, float32 out (+=), bf16 inputs, the default tiles (see dense_gemm.cuh).
#include "dense_gemm.cuh"

HUGEHEAD_DENSE_GEMM_INSTANCE(dense_gemm_bf16_dw_float, cutlass::bfloat16_t, hugehead::gemm::DenseKind::kDw, hugehead::gemm::DenseConfig::kDefault,
                             float, float)
