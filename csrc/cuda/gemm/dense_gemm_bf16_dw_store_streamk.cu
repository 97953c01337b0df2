// The dense backward GEMM dW = g^T x, out in the inputs' dtype, bf16 inputs, stream-K (see dense_gemm.cuh).
// Without GDC: CUTLASS 4.2's stream-K scheduler does not compile with CUTLASS_ENABLE_GDC_FOR_SM90 (its const
// is_last_tile binds a member to a non-const reference), so this kernel is launched without PDL (launch()).
#undef CUTLASS_ENABLE_GDC_FOR_SM90
#include "dense_gemm.cuh"

HUGEHEAD_DENSE_GEMM_INSTANCE(dense_gemm_bf16_dw_store_streamk, cutlass::bfloat16_t, hugehead::gemm::DenseKind::kDw, hugehead::gemm::DenseConfig::kStreamK,
                             void, cutlass::bfloat16_t)
