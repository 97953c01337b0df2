// CPU kernel of hugehead::chunk_topk_: fold a logits chunk into a running per-row top-k.
//
// Per row, in one read of the chunk: a value enters only if its key is strictly above the running k-th
// (a later class loses a tie), checked a block of 64 at a time with a vectorized test. The few that pass
// go to a buffer that is cut back to its best k (nth_element) whenever it reaches 2k, which raises the
// bar; at the end the buffer is sorted and merged with the running top-k. Rows run in parallel.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "hugehead/common.h"
#include "hugehead/cpu_rows.h"
#include "hugehead/cpu_simd.h"
#include "hugehead/entry.h"
#include "hugehead/topk.h"

namespace hugehead {
namespace {

constexpr int64_t kBlock = 64;

// Whether any of z[0 .. n) (+ b[0 .. n)) has a key above bar (float32, no softcap: the hot case,
// vectorized; the bias is added here, in the one read of the chunk, not by a separate pass).
HUGEHEAD_CPU_CLONES
bool any_key_above_f32(const float* z, const float* b, int64_t n, uint32_t bar) {
  int any = 0;
  if (b == nullptr) {
#pragma omp simd reduction(| : any)
    for (int64_t j = 0; j < n; ++j) any |= static_cast<int>(topk_key(z[j]) > bar);
  } else {
#pragma omp simd reduction(| : any)
    for (int64_t j = 0; j < n; ++j) any |= static_cast<int>(topk_key(z[j] + b[j]) > bar);
  }
  return any != 0;
}

template <typename scalar_t, typename acc_t, bool kSoftcap>
void chunk_topk_rows(const ChunkTopkParams& p, int64_t begin, int64_t end) {
  using key_t = topk_key_t<scalar_t>;
  struct Candidate {
    key_t key;
    int64_t col;
  };
  const auto better = [](const Candidate& a, const Candidate& b) {
    return a.key > b.key || (a.key == b.key && a.col < b.col);
  };
  constexpr key_t kNaN = static_cast<key_t>(~key_t(0));
  const int64_t k = p.k;
  const acc_t softcap = static_cast<acc_t>(p.softcap);
  const auto* bias = static_cast<const scalar_t*>(p.bias);
  const size_t limit = static_cast<size_t>(std::max<int64_t>(2 * k, 64));
  std::vector<Candidate> buf;
  buf.reserve(limit);
  std::vector<scalar_t> out_values(k);
  std::vector<int64_t> out_ids(k);
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* z = static_cast<const scalar_t*>(p.logits) + row * p.row_stride;
    scalar_t* values = static_cast<scalar_t*>(p.values) + row * k;
    int64_t* ids = p.indices + row * k;
    key_t bar = topk_threshold(values, ids, k);
    buf.clear();
    for (int64_t j0 = 0; j0 < p.cols && bar != kNaN; j0 += kBlock) {
      const int64_t j1 = std::min(j0 + kBlock, p.cols);
      // Softcap is monotonic but its rounding is not invertible: the other cases test each value.
      if constexpr (std::is_same_v<scalar_t, float> && !kSoftcap) {
        if (!any_key_above_f32(z + j0, bias == nullptr ? nullptr : bias + j0, j1 - j0, bar)) continue;
      }
      for (int64_t j = j0; j < j1; ++j) {
        const key_t key = topk_key(topk_value<scalar_t, acc_t, kSoftcap>(z[j], bias, j, softcap));
        if (key <= bar) continue;
        buf.push_back({key, j});
        if (buf.size() >= limit) {
          // Only the buffer's best k can still make the row's top k; a later value must beat its k-th.
          std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), better);
          buf.resize(k);
          bar = buf[k - 1].key;
          if (bar == kNaN) break;
        }
      }
    }
    if (buf.empty()) continue;
    std::sort(buf.begin(), buf.end(), better);
    // Merge: on equal keys the running entry (a lower class id) goes first.
    size_t q = 0;
    int64_t i = 0;
    for (int64_t o = 0; o < k; ++o) {
      const key_t running = ids[i] >= 0 ? topk_key(values[i]) : key_t(0);
      if (q < buf.size() && buf[q].key > running) {
        out_values[o] = topk_value<scalar_t, acc_t, kSoftcap>(z[buf[q].col], bias, buf[q].col, softcap);
        out_ids[o] = p.class_start + buf[q].col;
        ++q;
      } else {
        out_values[o] = values[i];
        out_ids[o] = ids[i];
        ++i;
      }
    }
    std::copy(out_values.begin(), out_values.end(), values);
    std::copy(out_ids.begin(), out_ids.end(), ids);
  }
}

void chunk_topk_cpu(const ChunkTopkParams& p, const at::Tensor& logits) {
  HUGEHEAD_DISPATCH_LOGITS(logits.scalar_type(), "chunk_topk_cpu", [&] {
    HUGEHEAD_BOOL_SWITCH(p.softcap > 0, kSoftcap, [&] {
      cpu::parallel_rows(p, chunk_topk_rows<scalar_t, at::opmath_type<scalar_t>, kSoftcap>);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(hugehead, CPU, m) { m.impl("chunk_topk_", &entry::chunk_topk<chunk_topk_cpu>); }

}  // namespace hugehead
