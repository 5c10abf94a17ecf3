// Decode attention read in place from the paged KV cache (node_agent/model/cpu_attention.py).
//
// One query token per row attends over the positions its block table names, reading each key and
// value where the pool keeps it: no copy of the context. Pools are [kv_heads, slots, head_dim]
// (node_agent/model/kv_cache.py), the tables [rows, max_blocks] (block ids, 0 the null block).
// A row sees positions [first, length), first = max(0, length - window) with a sliding window.
// GQA: each key/value head serves `groups` query heads; a key is loaded once for all of them.
// Softmax is online, one block at a time, accumulated in float32 whatever the storage dtype.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

namespace {

#ifndef CORTEX_PREFETCH_BLOCKS
#define CORTEX_PREFETCH_BLOCKS 1
#endif
constexpr int64_t kPrefetchBlocks = CORTEX_PREFETCH_BLOCKS;  // how far ahead a row's blocks are fetched

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* v, float* acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += a * static_cast<float>(v[i]);
}

template <typename T>
void decode(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lengths, T* out,
            int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t slots, int64_t max_blocks,
            int64_t block_size, double scale, int64_t window, double softcap) {
  const int64_t groups = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(groups * dim), acc(groups * dim), m(groups), l(groups), s(groups * block_size);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t row = job / kv_heads, kvh = job % kv_heads;
      const int64_t length = lengths[row];
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      for (int64_t g = 0; g < groups; ++g) {
        const T* qrow = q + (row * heads + kvh * groups + g) * dim;
        for (int64_t i = 0; i < dim; ++i) qf[g * dim + i] = static_cast<float>(qrow[i]) * static_cast<float>(scale);
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const T* kh = k + kvh * slots * dim;
      const T* vh = v + kvh * slots * dim;
      for (int64_t b = first / block_size; b * block_size < length && b < max_blocks; ++b) {
        const int64_t base = tables[row * max_blocks + b] * block_size;
        const int64_t lo = std::max(first, b * block_size) - b * block_size;
        const int64_t hi = std::min(length, (b + 1) * block_size) - b * block_size;
        const int64_t ahead = b + kPrefetchBlocks;  // a block further on is elsewhere: ask for it now
        if (ahead * block_size < length && ahead < max_blocks) {
          const int64_t next = tables[row * max_blocks + ahead] * block_size * dim;
          for (int64_t i = 0; i < block_size * dim; i += 64 / sizeof(T)) {
            __builtin_prefetch(kh + next + i);
            __builtin_prefetch(vh + next + i);
          }
        }
        for (int64_t t = lo; t < hi; ++t) {  // each key loaded once for its group's query heads
          const T* krow = kh + (base + t) * dim;
          for (int64_t g = 0; g < groups; ++g) s[g * block_size + t] = dot(qf.data() + g * dim, krow, dim);
        }
        for (int64_t g = 0; g < groups; ++g) {
          float* sg = s.data() + g * block_size;
          if (softcap > 0) {
            const float cap = static_cast<float>(softcap);
            for (int64_t t = lo; t < hi; ++t) sg[t] = cap * std::tanh(sg[t] / cap);
          }
          float top = m[g];
          for (int64_t t = lo; t < hi; ++t) top = std::max(top, sg[t]);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = lo; t < hi; ++t) {
            sg[t] = std::exp(sg[t] - top);
            sum += sg[t];
          }
          const float rescale = std::exp(m[g] - top);  // exp(-inf) = 0 at the first block
          float* ag = acc.data() + g * dim;
          if (rescale != 1.f) {
            for (int64_t i = 0; i < dim; ++i) ag[i] *= rescale;
          }
          l[g] = l[g] * rescale + sum;
          m[g] = top;
        }
        for (int64_t t = lo; t < hi; ++t) {  // each value loaded once too
          const T* vrow = vh + (base + t) * dim;
          for (int64_t g = 0; g < groups; ++g) axpy(s[g * block_size + t], vrow, acc.data() + g * dim, dim);
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        T* orow = out + (row * heads + kvh * groups + g) * dim;
        const float inv = l[g] > 0 ? 1.f / l[g] : 0.f;
        for (int64_t i = 0; i < dim; ++i) orow[i] = static_cast<T>(acc[g * dim + i] * inv);
      }
    }
  });
}

}  // namespace

// query [rows, heads, dim]; keys, values [kv_heads, slots, dim]; tables [rows, max_blocks] int64;
// lengths [rows] int64 (positions each row sees, its own included). Returns [rows, heads, dim].
at::Tensor paged_decode_attention(at::Tensor query, at::Tensor keys, at::Tensor values,
                                     at::Tensor tables, at::Tensor lengths, int64_t block_size,
                                     double scale, int64_t window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && keys.sizes() == values.sizes(), "bad shapes");
  TORCH_CHECK(query.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "query, keys and values must share a dtype");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong, "int64 tables and lengths");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), "the pools must be contiguous");
  const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = keys.size(0), slots = keys.size(1);
  TORCH_CHECK(keys.size(2) == dim && heads % kv_heads == 0 && tables.size(0) >= rows && lengths.size(0) >= rows,
              "mismatched sizes");
  auto q = query.contiguous();
  auto t = tables.contiguous();
  auto n = lengths.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                     t.data_ptr<int64_t>(), n.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), rows, heads, kv_heads,
                     dim, slots, t.size(1), block_size, scale, window, softcap);
  });
  return out;
}

// An operator (torch.ops.cortex.paged_decode_attention), so the profiler and the dispatcher see it.
TORCH_LIBRARY(cortex, m) {
  m.def("paged_decode_attention(Tensor query, Tensor keys, Tensor values, Tensor tables, Tensor lengths, "
        "int block_size, float scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(cortex, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
