// Every op schema of the hugehead namespace, and the Python module init. Kernels live in cpu/ and
// cuda/ under the same file names and register with TORCH_LIBRARY_IMPL. Each op works on one device
// and one vocabulary chunk; the chunk loop, the merge across shards and autograd are in Python.
#include <pybind11/pybind11.h>  // torch's bundled copy (see CMakeLists.txt)
#include <torch/library.h>

TORCH_LIBRARY(hugehead, m) {
  // Fold a logits chunk [N, C] holding classes [class_start, class_start + C) into running per-row
  // (max, sum of exp(logit - max), target logit, sum of logits). softcap <= 0 means no softcap.
  m.def(
      "chunk_stats_(Tensor logits, Tensor target, int class_start, float softcap, Tensor(a!) row_max, "
      "Tensor(b!) row_sumexp, Tensor(c!) target_logit, Tensor(d!) logit_sum) -> ()");
  // chunk_stats_ of the logits chunk x [N, D] @ weight [C, D]^T (+ bias [C]) without materializing it: one
  // GEMM whose epilogue does the statistics (CUTLASS, sm_90a; a CUDA kernel only in builds with CUTLASS).
  // The logits are rounded to x's dtype (as a stored GEMM output would be) before the statistics.
  // with_logit_sum=False: logit_sum is left as it is (only label smoothing needs it; the GEMM skips it).
  // logits [N, C] (x's dtype, optional): the same GEMM also stores the logits there (no softcap).
  // exact=True (no bias, softcap or logits): the float32 accumulator is the logit, not rounded to x's dtype (the
  // loop asks it of gemm_chunk_grad_ too, so the forward's lse and the backward's logits agree).
  // reference [N] float32 (optional): each row's max over the chunks folded before, which the GEMM folds against
  // (it may be row_max itself); probs=True (bf16): logits gets exp(min(z - reference, 80)) in place of z, and a row
  // folded again (its logits far above the reference) exp(z - M) with reference[row] set to M, its chunk max.
  m.def(
      "gemm_chunk_stats_(Tensor x, Tensor weight, Tensor? bias, Tensor target, int class_start, float softcap, "
      "Tensor(a!) row_max, Tensor(b!) row_sumexp, Tensor(c!) target_logit, Tensor(d!) logit_sum, "
      "bool with_logit_sum=True, Tensor(e!)? logits=None, Tensor(f!)? reference=None, bool probs=False, "
      "bool exact=False) -> ()");
  // chunk_grad_ of the logits chunk x @ weight^T (+ bias) without materializing it: the recompute GEMM's
  // epilogue writes dLoss/dlogits into grad_logits [N, C] (x's dtype). CUTLASS builds only, as above.
  m.def(
      "gemm_chunk_grad_(Tensor x, Tensor weight, Tensor? bias, Tensor target, int class_start, int num_classes, "
      "Tensor lse, Tensor grad_rows, float label_smoothing, float z_loss, float softcap, Tensor? grad_lse, "
      "Tensor(a!) grad_logits, bool exact=False) -> ()");
  // Replace a logits chunk [N, C] by dLoss/dlogits in place, given every row's final lse and
  // dLoss/dloss_row (zero for ignored rows), with label smoothing, z-loss and softcap folded in.
  // grad_lse (optional, [N]): the gradient reaching a returned per-row lse, added as g_lse * softmax.
  m.def(
      "chunk_grad_(Tensor(a!) logits, Tensor target, int class_start, int num_classes, Tensor lse, "
      "Tensor grad_rows, float label_smoothing, float z_loss, float softcap, Tensor? grad_lse=None) -> ()");
  // Fold a logits chunk [N, C] holding classes [class_start, class_start + C) (bias [C], optional, added
  // first) into a running per-row top-k: values [N, k] (the logits' dtype, softcapped) and indices [N, k]
  // int64, sorted by value descending, NaN first, ties to the lower class id; index -1 marks a still empty
  // slot. Every class of the chunk must be above every id already held (chunks come in ascending order).
  m.def(
      "chunk_topk_(Tensor logits, Tensor? bias, int class_start, float softcap, Tensor(a!) values, "
      "Tensor(b!) indices) -> ()");
  // Sparse [N, V] targets as CSR (crow [N + 1] absolute offsets, col [nnz] int64 class ids sorted within
  // each row, val [nnz] in the accumulation dtype); a row's entries in the chunk are found by binary search.
  // Softmax with probability targets, forward: chunk_stats_ with target_logit replaced by target_dot
  // (+= sum of val * logit over the row's entries in the chunk); class_weight ([C], optional) weights
  // logit_sum (label smoothing with class weights).
  m.def(
      "sparse_chunk_stats_(Tensor logits, Tensor crow, Tensor col, Tensor val, int class_start, float softcap, "
      "Tensor? class_weight, Tensor(a!) row_max, Tensor(b!) row_sumexp, Tensor(c!) target_dot, "
      "Tensor(d!) logit_sum) -> ()");
  // Its gradient in place: g (target_mass softmax - eps/V w_j - (1 - eps) val [entry] + 2 z_loss lse softmax)
  // + g_lse softmax, through the softcap; target_mass [N] is the row's total (smoothed, weighted) target.
  m.def(
      "sparse_chunk_grad_(Tensor(a!) logits, Tensor crow, Tensor col, Tensor val, int class_start, "
      "int num_classes, Tensor lse, Tensor grad_rows, Tensor target_mass, float label_smoothing, float z_loss, "
      "float softcap, Tensor? class_weight=None, Tensor? grad_lse=None) -> ()");
  // One-vs-all binary cross-entropy of a chunk: row_loss (optional) += the chunk's per-logit losses;
  // with grad_rows, the chunk becomes grad_rows * dLoss/dlogits in place (in the same pass). entry_weight
  // ([nnz], optional): 1 + (pos_weight - 1) t per entry.
  m.def(
      "bce_chunk_(Tensor(a!) logits, Tensor crow, Tensor col, Tensor val, Tensor? entry_weight, int class_start, "
      "Tensor(b!)? row_loss, Tensor? grad_rows) -> ()");
  // self *= scale in place, scale a one-element float32/float64 tensor on self's device, read there (no host
  // synchronization): the product in float32 (float64 for float64 self) with the scale in full, rounded
  // once to self's dtype, as CPU ATen's self.mul_(scale) (CUDA's rounds a 0-d float32 scale to a 16-bit
  // self's dtype first, and runs unvectorized). The backward of an op whose gradients the forward made.
  m.def("scale_(Tensor(a!) self, Tensor scale) -> ()");
  // out = x * scale[:, None] for a 2-D x and a row vector scale in x's accumulation dtype: the product in that
  // dtype, rounded once to out's (x's) dtype, as ATen's torch.mul(x, scale[:, None], out=out) (whose CUDA
  // kernel takes the broadcast-with-cast path there: ~0.7 TB/s). A kept chunk's s x in the factored backward.
  m.def("row_scale(Tensor(a!) out, Tensor x, Tensor scale) -> ()");
}

PYBIND11_MODULE(_C, module) {
  module.doc() = "hugehead kernels: importing this registers torch.ops.hugehead.*";
  module.def("cuda_built", []() { return bool(HUGEHEAD_WITH_CUDA); },
             "True when this build includes the CUDA kernels");
  module.def("cutlass_built", []() { return bool(HUGEHEAD_WITH_CUTLASS); },
             "True when this build includes the CUTLASS sm_90a GEMMs (csrc/cuda/gemm/)");
}
