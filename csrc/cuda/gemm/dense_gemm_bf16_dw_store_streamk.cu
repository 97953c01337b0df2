// The dense backward GEMM dW = g^T x, out in the inputs' dtype, bf16 inputs, stream-K (see dense_gemm.cuh).
#include "dense_gemm.cuh"

HUGEHEAD_DENSE_GEMM_INSTANCE(dense_gemm_bf16_dw_store_streamk, cutlass::bfloat16_t, hugehead::gemm::DenseKind::kDw, hugehead::gemm::DenseConfig::kStreamK,
                             void, cutlass::bfloat16_t)
