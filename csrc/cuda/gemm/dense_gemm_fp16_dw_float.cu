// The dense backward GEMM dW = g^T x, float32 out (+=), fp16 inputs, the default tiles (see dense_gemm.cuh).
#include "dense_gemm.cuh"

HUGEHEAD_DENSE_GEMM_INSTANCE(dense_gemm_fp16_dw_float, cutlass::half_t, hugehead::gemm::DenseKind::kDw, hugehead::gemm::DenseConfig::kDefault,
                             float, float)
