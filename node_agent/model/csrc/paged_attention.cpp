// Attention read in place from the paged KV cache (node_agent/model/cpu_attention.py): decode
// rows (`paged_decode_attention`) and prefill chunks (`paged_prefill_attention`, below).
//
// One query token per row attends over the positions its block table names, reading each key and
// value where the pool keeps it: no copy of the context. Pools are [kv_heads, slots, head_dim]
// (node_agent/model/kv_cache.py), the tables [rows, max_blocks] (block ids, 0 the null block).
// A row sees positions [first, length), first = max(0, length - window) with a sliding window.
// GQA: each key/value head serves `groups` query heads; a key is loaded once for several of them.
// Softmax is online, a tile of 8 or 16 positions (a vector's width) at a time, in float32
// whatever the storage dtype. Written over GCC's vector types, so that the same source
// vectorises for AVX-512, AVX2 or NEON; head dims 64, 128 and 256 are compiled in (queries
// and sums held in registers), any other up to kMaxDim runs the same code with the dim read at
// run time.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <vector>
#include <cmath>
#include <algorithm>
#include <limits>

namespace {

#ifndef CORTEX_PREFETCH_BLOCKS
#define CORTEX_PREFETCH_BLOCKS 1
#endif
constexpr int64_t kPrefetchBlocks = CORTEX_PREFETCH_BLOCKS;  // how far ahead a row's blocks are fetched

// Vectors of the machine's width (GCC's vector extension): 16 floats with AVX-512, 8 otherwise
// (AVX2; two registers on NEON).
#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;  // AVX2, NEON (two registers there)
#endif
constexpr int64_t kMaxDim = 256;
constexpr int64_t kMaxChunks = kMaxDim / kLanes;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));
#ifdef __AVX512F__
constexpr IVec kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
constexpr IVec kIota = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

inline Vec splat(float x) { return Vec{} + x; }

// `lanes` values from p (the rest 0), as float32.
template <typename T>
inline Vec load_vec(const T* p, int64_t lanes = kLanes) {
  Vec out{};
  for (int64_t j = 0; j < lanes; ++j) out[j] = static_cast<float>(p[j]);
  return out;
}
template <>
inline Vec load_vec<float>(const float* p, int64_t lanes) {
  Vec out{};
  __builtin_memcpy(&out, p, lanes * sizeof(float));
  return out;
}

inline Vec larger(Vec a, Vec b) { return a > b ? a : b; }

#ifdef __AVX512F__
inline Vec swap8(Vec v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7); }
inline Vec swap4(Vec v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11); }
inline Vec swap2(Vec v) { return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13); }
inline Vec swap1(Vec v) { return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14); }
// Lane t of the result: the sum of v[t]'s lanes (16 horizontal sums in 15 shuffle-and-add steps).
inline Vec lane_sums(const Vec* v) {
  Vec h[8], q[4], e[2];
  for (int i = 0; i < 8; ++i)
    h[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    q[i] = __builtin_shufflevector(h[2 * i], h[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(h[2 * i], h[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(q[2 * i], q[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
inline Vec swap4(Vec v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3); }
inline Vec swap2(Vec v) { return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5); }
inline Vec swap1(Vec v) { return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6); }
// Lane t of the result: the sum of v[t]'s lanes (8 horizontal sums in 7 shuffle-and-add steps).
inline Vec lane_sums(const Vec* v) {
  Vec q[4], e[2];
  for (int i = 0; i < 4; ++i)
    q[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    e[i] = __builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(q[2 * i], q[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

// `combine` over a vector's lanes, by halving it: the lanes swapped in blocks of 8 (AVX-512), 4, 2, 1.
template <typename Combine>
inline float across(Vec v, Combine combine) {
#ifdef __AVX512F__
  v = combine(v, swap8(v));
#endif
  v = combine(v, swap4(v));
  v = combine(v, swap2(v));
  return combine(v, swap1(v))[0];
}

inline float sum(Vec v) { return across(v, [](Vec a, Vec b) { return a + b; }); }
inline float largest(Vec v) { return across(v, larger); }

// e^x for x <= 0 (scores less their maximum): x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// degree-6 Taylor polynomial (relative error < 2e-7), 2^n put in the exponent bits; 0 below -87.
inline Vec exp_nonpositive(Vec x) {
  const IVec tiny = x < -87.f;
  x = tiny ? splat(-87.f) : x;
  const IVec n = __builtin_convertvector(x * 1.44269504f - 0.5f, IVec);  // round to nearest (x <= 0)
  const Vec nf = __builtin_convertvector(n, Vec);
  const Vec r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;
  Vec p = splat(1.f / 720.f);
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const IVec bits = (n + 127) << 23;
  Vec scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return tiny ? splat(0.f) : p * scale;
}

// tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|), lane by lane.
inline Vec tanh(Vec x) {
  const Vec e = exp_nonpositive(x < 0 ? 2.f * x : -2.f * x);
  const Vec magnitude = (1.f - e) / (1.f + e);
  return x < 0 ? -magnitude : magnitude;
}

// One row's attention over one KV head for GB of the query heads that share it, positions
// [first, length): tiles of up to kLanes positions within a block, an online softmax over them.
// D: the head dim when compiled (0: `dim_`, up to kMaxDim); the queries and sums of a tile are held
// in registers when D is known, each key and value loaded once for the GB heads.
template <typename T, int64_t D, int64_t GB>
void attend(const T* q, float scale, const T* kh, const T* vh, const int64_t* table, int64_t first, int64_t length,
            int64_t block_size, float softcap, int64_t dim_, T* out) {
  const int64_t dim = D ? D : dim_;
  constexpr int64_t kChunks = D ? (D + kLanes - 1) / kLanes : kMaxChunks;
  const int64_t chunks = (dim + kLanes - 1) / kLanes, tail = dim - (chunks - 1) * kLanes;
  auto lanes = [&](int64_t c) { return c == chunks - 1 ? tail : kLanes; };
  Vec query[GB][kChunks], acc[GB][kChunks];
  float m[GB], l[GB];
  for (int64_t g = 0; g < GB; ++g) {
    for (int64_t c = 0; c < chunks; ++c) {
      query[g][c] = load_vec(q + g * dim + c * kLanes, lanes(c)) * scale;
      acc[g][c] = Vec{};
    }
    m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.f;
  }
  alignas(64) float weights[GB][kLanes];
  Vec partial[GB][kLanes];
  for (int64_t p = first; p < length;) {
    const int64_t in_block = p % block_size;
    const int64_t count = std::min(std::min(kLanes, block_size - in_block), length - p);
    const int64_t slot = table[p / block_size] * block_size + in_block, next = p + count;
    if (in_block == 0) {  // a block further on is elsewhere: ask for it now
      const int64_t ahead = (p / block_size + kPrefetchBlocks) * block_size;
      if (ahead < length) {
        const int64_t at = table[ahead / block_size] * block_size * dim;
        for (int64_t i = 0; i < block_size * dim; i += 64 / sizeof(T)) {
          __builtin_prefetch(kh + at + i);
          __builtin_prefetch(vh + at + i);
        }
      }
    }
    for (int64_t t = 0; t < kLanes; ++t) {  // past the tile: its last key again, masked below
      const T* key = kh + (slot + std::min(t, count - 1)) * dim;
      Vec k[kChunks];
      for (int64_t c = 0; c < chunks; ++c) k[c] = load_vec(key + c * kLanes, lanes(c));
      for (int64_t g = 0; g < GB; ++g) {
        Vec dot = query[g][0] * k[0];
        for (int64_t c = 1; c < chunks; ++c) dot += query[g][c] * k[c];
        partial[g][t] = dot;
      }
    }
    const IVec outside = kIota >= static_cast<int32_t>(count);
    for (int64_t g = 0; g < GB; ++g) {
      Vec score = lane_sums(partial[g]);
      if (softcap > 0) score = softcap * tanh(score / softcap);
      score = outside ? splat(-std::numeric_limits<float>::infinity()) : score;
      const float top = std::max(m[g], largest(score));
      const Vec weight = outside ? splat(0.f) : exp_nonpositive(score - top);
      const float rescale = exp_nonpositive(splat(m[g] - top))[0];  // 0 at the first tile (m = -inf)
      l[g] = l[g] * rescale + sum(weight);
      m[g] = top;
      __builtin_memcpy(weights[g], &weight, sizeof(weight));
      for (int64_t c = 0; c < chunks; ++c) acc[g][c] *= rescale;
    }
    for (int64_t t = 0; t < count; ++t) {
      const T* value = vh + (slot + t) * dim;
      for (int64_t c = 0; c < chunks; ++c) {
        const Vec v = load_vec(value + c * kLanes, lanes(c));
        for (int64_t g = 0; g < GB; ++g) acc[g][c] += weights[g][t] * v;
      }
    }
    p = next;
  }
  for (int64_t g = 0; g < GB; ++g) {
    const float inv = l[g] > 0 ? 1.f / l[g] : 0.f;
    for (int64_t c = 0; c < chunks; ++c) {
      const Vec o = acc[g][c] * inv;
      for (int64_t j = 0; j < lanes(c); ++j) out[g * dim + c * kLanes + j] = static_cast<T>(o[j]);
    }
  }
}

// The G query heads of each KV head in slices of GB (held in registers with their sums when the
// head dim D is known when compiled).
template <typename T, int64_t D, int64_t GB>
void decode(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lengths, T* out,
            int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, int64_t slots, int64_t max_blocks,
            int64_t block_size, double scale, int64_t window, double softcap) {
  const int64_t slices = heads / GB, per_kv_head = heads / kv_heads / GB;
  at::parallel_for(0, rows * slices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t row = job / slices, kvh = job % slices / per_kv_head;
      const int64_t length = lengths[row];
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t at = (row * heads + job % slices * GB) * dim;
      attend<T, D, GB>(q + at, static_cast<float>(scale), k + kvh * slots * dim, v + kvh * slots * dim,
                       tables + row * max_blocks, first, std::min(length, max_blocks * block_size), block_size,
                       static_cast<float>(softcap), dim, out + at);
    }
  });
}

template <typename T>
using Decode = decltype(&decode<T, 0, 1>);

// The instance for a head dim and group size: D = 64, 128 or 256 compiled in, the group's heads taken
// 4, 3, 2 or 1 at a time for D = 64 (the largest that divides the group), one at a time otherwise
// (D = 256 too).
template <typename T>
Decode<T> pick(int64_t dim, int64_t groups) {
  if (dim == 64) {
    return groups % 4 == 0 ? decode<T, 64, 4> : groups % 3 == 0 ? decode<T, 64, 3>
         : groups % 2 == 0 ? decode<T, 64, 2> : decode<T, 64, 1>;
  }
  return dim == 128 ? decode<T, 128, 1> : dim == 256 ? decode<T, 256, 1> : decode<T, 0, 1>;
}


// ---- Prefill: a chunk of one row's prompt, causally over the row's cache --------------------------
//
// A chunk's L queries at positions start..start+L-1 attend over positions 0..start+L-1 (their own
// keys and values are in the cache already): flash attention in tiles, its two products by
// oneDNN's batch-reduce GEMM (ATen's cpublas::brgemm, JIT-compiled for the machine's vector
// units: ~250 GFLOP/s a core on Zen 5 where torch's CPU flash attention runs ~90 for these
// shapes). First each KV head's keys are packed transposed ([dim, tile] per tile) and its values
// contiguously ([positions, dim]), in float32 whatever the pools' dtype, from the blocks the row's
// table names; then each (query head, tile of kQueryTile queries) runs an online softmax over the
// key tiles up to its last position, the diagonal tile masked.

constexpr int64_t kQueryTile = 64;

// One KV head's keys at positions [first, first + tile) as [dim, tile] and its values as [tile,
// dim]; positions from `length` on are zeros (masked by the causal mask: no query sees them).
template <typename T>
void pack_tile(const T* kh, const T* vh, const int64_t* table, int64_t block_size, int64_t first,
               int64_t tile, int64_t length, int64_t dim, float* keys_t, float* values) {
  for (int64_t j = 0; j < tile; ++j) {
    const int64_t p = first + j;
    if (p >= length) {
      for (int64_t d = 0; d < dim; ++d) keys_t[d * tile + j] = 0.f;
      std::fill(values + j * dim, values + (j + 1) * dim, 0.f);
      continue;
    }
    const int64_t slot = table[p / block_size] * block_size + p % block_size;
    const T* key = kh + slot * dim;
    const T* value = vh + slot * dim;
    for (int64_t d = 0; d < dim; ++d) keys_t[d * tile + j] = static_cast<float>(key[d]);
    for (int64_t d = 0; d < dim; ++d) values[j * dim + d] = static_cast<float>(value[d]);
  }
}

// The running softmax of query rows [0, rows) over one tile's scores s ([rows, tile], in place:
// the weights on return): `top` and `total` the rows' maxima and sums so far, `acc` [rows, dim]
// rescaled to the new maxima. Scores of positions after a row's own (`seen[i]` positions of the
// tile) are masked.
void softmax_tile(float* s, int64_t rows, int64_t tile, const int64_t* seen, float* top, float* total, float* acc,
                  int64_t dim) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = s + i * tile;
    const int64_t visible = std::max<int64_t>(0, std::min(seen[i], tile));
    for (int64_t j = visible; j < tile; ++j) row[j] = -std::numeric_limits<float>::infinity();
    Vec best = splat(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < tile; j += kLanes) best = larger(best, load_vec(row + j));
    const float next = std::max(top[i], largest(best));
    const float rescale = exp_nonpositive(splat(top[i] - next))[0];  // 0 at the first tile (top = -inf)
    Vec sums{};
    for (int64_t j = 0; j < tile; j += kLanes) {
      const Vec w = exp_nonpositive(load_vec(row + j) - next);
      __builtin_memcpy(row + j, &w, sizeof(w));
      sums += w;
    }
    total[i] = total[i] * rescale + sum(sums);
    top[i] = next;
    for (int64_t d = 0; d < dim; ++d) acc[i * dim + d] *= rescale;
  }
}

template <typename T>
void prefill(const T* q, const T* k, const T* v, const int64_t* table, T* out, float* keys_t,
             float* values, int64_t length, int64_t start, int64_t heads, int64_t kv_heads, int64_t dim,
             int64_t slots, int64_t block_size, int64_t tile, float scale) {
  const int64_t seen = start + length, tiles = (seen + tile - 1) / tile, padded = tiles * tile;
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t kvh = job / tiles, t = job % tiles;
      pack_tile(k + kvh * slots * dim, v + kvh * slots * dim, table, block_size, t * tile, tile, seen, dim,
                keys_t + (kvh * padded + t * tile) * dim, values + (kvh * padded + t * tile) * dim);
    }
  });
  const int64_t query_tiles = (length + kQueryTile - 1) / kQueryTile, group = heads / kv_heads;
  at::parallel_for(0, heads * query_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(kQueryTile * dim), scores(kQueryTile * tile), acc(kQueryTile * dim);
    float top[kQueryTile], total[kQueryTile];
    int64_t visible[kQueryTile];
    for (int64_t job = begin; job < end; ++job) {
      const int64_t h = job / query_tiles, first = job % query_tiles * kQueryTile;
      const int64_t rows = std::min(kQueryTile, length - first), kvh = h / group;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t d = 0; d < dim; ++d)
          queries[i * dim + d] = static_cast<float>(q[(h * length + first + i) * dim + d]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(top, top + rows, -std::numeric_limits<float>::infinity());
      std::fill(total, total + rows, 0.f);
      const int64_t last = start + first + rows - 1;  // the tile's last query's position
      for (int64_t t = 0; t * tile <= last; ++t) {
        const float* kt = keys_t + (kvh * padded + t * tile) * dim;
        const float* vt = values + (kvh * padded + t * tile) * dim;
        at::native::cpublas::brgemm(rows, tile, dim, dim, tile, tile, false, queries.data(), kt, scores.data(),
                                    false);
        for (int64_t i = 0; i < rows; ++i) visible[i] = start + first + i + 1 - t * tile;
        softmax_tile(scores.data(), rows, tile, visible, top, total, acc.data(), dim);
        at::native::cpublas::brgemm(rows, dim, tile, tile, dim, dim, true, scores.data(), vt, acc.data(), false);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const float inv = 1.f / total[i];
        T* o = out + ((first + i) * heads + h) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(acc[i * dim + d] * inv);
      }
    }
    at::native::cpublas::brgemm_release(false);
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
  TORCH_CHECK(dim <= kMaxDim, "head dims up to ", kMaxDim);
  TORCH_CHECK(keys.size(2) == dim && heads % kv_heads == 0 && tables.size(0) >= rows && lengths.size(0) >= rows,
              "mismatched sizes");
  auto q = query.contiguous();
  auto t = tables.contiguous();
  auto n = lengths.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const auto run = pick<scalar_t>(dim, heads / kv_heads);
    run(q.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(), t.data_ptr<int64_t>(),
        n.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), rows, heads, kv_heads, dim, slots, t.size(1), block_size,
        scale, window, softcap);
  });
  return out;
}


// query [heads, length, dim] (float32, bfloat16 or float16, as the pools; the products run in
// float32): a chunk of one row at positions start..start+length-1, its
// keys and values already written; keys, values [kv_heads, slots, dim]; table [max_blocks] int64
// (the row's); keys_t, values_scratch: float32 buffers of at least kv_heads * ceil((start + length)
// / tile) * tile * dim each. Returns [length, heads, dim].
at::Tensor paged_prefill_attention(at::Tensor query, at::Tensor keys, at::Tensor values, at::Tensor table,
                                   int64_t start, int64_t block_size, double scale, int64_t tile,
                                   at::Tensor keys_t, at::Tensor values_scratch) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && keys.sizes() == values.sizes(), "bad shapes");
  TORCH_CHECK(query.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "query, keys and values must share a dtype");
  TORCH_CHECK(keys_t.scalar_type() == at::kFloat && values_scratch.scalar_type() == at::kFloat,
              "float32 scratch buffers (the products run in float32)");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 1, "an int64 table");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys_t.is_contiguous() &&
              values_scratch.is_contiguous(), "contiguous pools and buffers");
  TORCH_CHECK(tile > 0 && tile % kLanes == 0, "a key tile of a multiple of ", kLanes, " positions");
  const int64_t heads = query.size(0), length = query.size(1), dim = query.size(2);
  const int64_t kv_heads = keys.size(0), slots = keys.size(1);
  const int64_t padded = (start + length + tile - 1) / tile * tile;
  TORCH_CHECK(keys.size(2) == dim && heads % kv_heads == 0, "mismatched sizes");
  TORCH_CHECK(table.size(0) * block_size >= start + length, "the table is shorter than the chunk's positions");
  TORCH_CHECK(keys_t.numel() >= kv_heads * padded * dim && values_scratch.numel() >= kv_heads * padded * dim,
              "scratch buffers too small");
  auto q = query.contiguous();
  auto t = table.contiguous();
  auto out = at::empty({length, heads, dim}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    prefill<scalar_t>(q.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(), values.data_ptr<scalar_t>(),
                      t.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), keys_t.data_ptr<float>(),
                      values_scratch.data_ptr<float>(), length, start, heads, kv_heads, dim, slots, block_size, tile,
                      static_cast<float>(scale));
  });
  return out;
}

// Operators (torch.ops.cortex.*), so the profiler and the dispatcher see them.
TORCH_LIBRARY(cortex, m) {
  m.def("paged_decode_attention(Tensor query, Tensor keys, Tensor values, Tensor tables, Tensor lengths, "
        "int block_size, float scale, int window, float softcap) -> Tensor");
  m.def("paged_prefill_attention(Tensor query, Tensor keys, Tensor values, Tensor table, int start, "
        "int block_size, float scale, int tile, Tensor keys_t, Tensor values_scratch) -> Tensor");
}

TORCH_LIBRARY_IMPL(cortex, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
