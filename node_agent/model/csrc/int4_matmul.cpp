// A 4-bit layer's matmul on a CPU (node_agent/model/quantized_linear.py, int4_tiles.py), over the
// weights torch's CPU int4 kernel packed (`_convert_weight_to_int4pack_for_cpu`), chosen by rows:
// - few rows: torch's kernel (`_weight_int4pack_mm_for_cpu`), a matrix-vector one.
// - many rows: the weights dequantised a tile of output channels at a time into float32, into a
//   buffer of the thread's own that stays in its cache, and each tile multiplied by all the rows at
//   once with oneDNN's batch-reduce GEMM (ATen's cpublas::brgemm). Torch's kernel re-reads and
//   re-dequantises every weight for each 4 rows; here each weight is dequantised once a call,
//   whatever the rows.
// One C++ operator for both, so that a compiled step calls the kernel with no Python between.
//
// Torch's packing, per block of `block_n` output channels (32 with AVX2, 64 with AVX-512), is
// input-major: for each input k, block_n / 2 bytes. In a whole block, byte b holds channel b in its
// low nibble and channel b + block_n / 2 in its high one (`split_halves`); in a last, narrower
// block (and on CPUs without AVX2) byte b holds channels 2b and 2b + 1. Scales and zeros are
// [in / group, out, 2] bfloat16; a weight reads (q - 8) * scale + zero, as torch's kernel reads it.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <vector>

namespace {

constexpr int64_t kRowChunk = 64;  // rows a GEMM call takes (a prefill chunk runs as several)
constexpr int64_t kBf16FromRows = 128;  // rows from which bfloat16 GEMMs run on AMX (amx_tiles)

// Channels [start, start + width) of the layer as float32 [in, width] (row k: input k's weights).
void dequantise_tile(const uint8_t* packed, const at::BFloat16* scales_and_zeros, int64_t out_features,
                     int64_t in_features, int64_t group, int64_t start, int64_t width, bool halves,
                     float* __restrict__ tile, float* __restrict__ scale, float* __restrict__ zero) {
  const uint8_t* block = packed + start * in_features / 2;
  const int64_t half = width / 2;
  for (int64_t g = 0; g < in_features / group; ++g) {
    const at::BFloat16* sz = scales_and_zeros + (g * out_features + start) * 2;
    for (int64_t n = 0; n < width; ++n) {
      scale[n] = static_cast<float>(sz[2 * n]);
      zero[n] = static_cast<float>(sz[2 * n + 1]);
    }
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      const uint8_t* bytes = block + k * half;
      float* row = tile + k * width;
#if defined(__AVX512F__)  // 16 channels an instruction (whole blocks are 64 channels here: half is 32)
      if (halves && half % 16 == 0) {
        const __m512i mask = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
        for (int64_t b = 0; b < half; b += 16) {
          const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + b)));
          _mm512_storeu_ps(row + b, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(codes, mask), eight)),
                                                    _mm512_loadu_ps(scale + b), _mm512_loadu_ps(zero + b)));
          _mm512_storeu_ps(row + half + b,
                           _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(codes, 4), eight)),
                                           _mm512_loadu_ps(scale + half + b), _mm512_loadu_ps(zero + half + b)));
        }
        continue;
      }
#endif
#if defined(__AVX2__)  // GCC's vector extension converts bytes to floats one at a time: intrinsics
      if (halves) {
        const __m256i mask = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
        for (int64_t b = 0; b < half; b += 8) {
          const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + b)));
          _mm256_storeu_ps(row + b, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(codes, mask), eight)),
                                                    _mm256_loadu_ps(scale + b), _mm256_loadu_ps(zero + b)));
          _mm256_storeu_ps(row + half + b,
                           _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(codes, 4), eight)),
                                           _mm256_loadu_ps(scale + half + b), _mm256_loadu_ps(zero + half + b)));
        }
        continue;
      }
#endif
      if (halves) {
        for (int64_t b = 0; b < half; ++b) {
          row[b] = static_cast<float>((bytes[b] & 15) - 8) * scale[b] + zero[b];
          row[half + b] = static_cast<float>((bytes[b] >> 4) - 8) * scale[half + b] + zero[half + b];
        }
      } else {
        for (int64_t b = 0; b < half; ++b) {
          row[2 * b] = static_cast<float>((bytes[b] & 15) - 8) * scale[2 * b] + zero[2 * b];
          row[2 * b + 1] = static_cast<float>((bytes[b] >> 4) - 8) * scale[2 * b + 1] + zero[2 * b + 1];
        }
      }
    }
  }
}

#if defined(__AVX512F__)
// 16 floats rounded to bfloat16, to nearest even (finite values: weights)
inline __m256i round_bf16(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
}

// A float32 tile [k, n] as two bfloat16 tiles in oneDNN's VNNI layout ([k / 2, n, 2]: inputs 2p and
// 2p + 1 of a channel side by side), `high` its values rounded to bfloat16 and `low` what that
// rounding left, rounded too: high + low carries 16 bits of each weight, which holds a 4-bit weight,
// (q - 8) * scale + zero with bfloat16 scale and zero, exactly or to within 2^-17 of it.
void split_tile(const float* tile, int64_t k, int64_t n, at::BFloat16* high, at::BFloat16* low) {
  alignas(64) static const int16_t order[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(order);
  for (int64_t p = 0; p < k / 2; ++p) {
    for (int64_t c = 0; c < n; c += 16) {
      __m256i hi[2], lo[2];
      for (int e = 0; e < 2; ++e) {
        const __m512 v = _mm512_loadu_ps(tile + (2 * p + e) * n + c);
        hi[e] = round_bf16(v);
        const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi[e]), 16));
        lo[e] = round_bf16(_mm512_sub_ps(v, rounded));
      }
      at::BFloat16* at_high = high + (p * n + c) * 2;
      at::BFloat16* at_low = low + (p * n + c) * 2;
      _mm512_storeu_si512(at_high, _mm512_permutex2var_epi16(_mm512_castsi256_si512(hi[0]), interleave,
                                                             _mm512_castsi256_si512(hi[1])));
      _mm512_storeu_si512(at_low, _mm512_permutex2var_epi16(_mm512_castsi256_si512(lo[0]), interleave,
                                                            _mm512_castsi256_si512(lo[1])));
    }
  }
}
#endif

// Columns [0, width) of `rows` rows of `out` (row stride `ld`) rounded to bfloat16's precision in place,
// as torch's int4 kernel rounds its products: a row's result is the same whichever path runs it.
void round_to_bf16(float* out, int64_t rows, int64_t width, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = out + r * ld;
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= width; c += 16)
      _mm512_storeu_ps(row + c, _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(round_bf16(_mm512_loadu_ps(row + c))), 16)));
#endif
    for (; c < width; ++c) row[c] = static_cast<float>(static_cast<at::BFloat16>(row[c]));
  }
}

// Whether many rows run as bfloat16 GEMMs (split_tile): a CPU with AMX, where oneDNN's bfloat16 GEMM
// is several times its float32 one (two of them: 2.3x faster than one float32 tile GEMM at 512 rows
// of SmolLM2's layers on a 2-core Xeon); elsewhere a bfloat16 GEMM is at most twice a float32 one.
bool amx_tiles() {
#if defined(__AVX512F__) && defined(__GNUC__)
  static const bool yes = __builtin_cpu_supports("amx-bf16") && at::native::cpublas::could_pack(at::kBFloat16);
  return yes;
#else
  return false;
#endif
}

// The tiles over x [rows, in] (float32, or bfloat16: the kernels' activations) into float32 [rows, out],
// each tile's products rounded to bfloat16's precision where `round_output`.
at::Tensor tiled(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros, int64_t group,
                 int64_t block_n, bool split_halves, bool round_output) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4_tiled_matmul: x must be float32 or bfloat16 [rows, in]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && scales_and_zeros.scalar_type() == at::kBFloat16,
              "int4_tiled_matmul: packed uint8 weights and bfloat16 scales and zeros");
  TORCH_CHECK(block_n > 0 && block_n % 16 == 0, "int4_tiled_matmul: block_n ", block_n);
  const at::Tensor a = x.contiguous();
  const at::Tensor w = packed.contiguous();
  const at::Tensor sz = scales_and_zeros.contiguous();
  const int64_t rows = a.size(0), in_features = a.size(1), out_features = sz.size(1);
  TORCH_CHECK(w.numel() * 2 == out_features * in_features && in_features % group == 0,
              "int4_tiled_matmul: weights of ", w.numel(), " bytes for ", out_features, " x ", in_features);
  at::Tensor out = at::empty({rows, out_features}, a.options().dtype(at::kFloat));
  const uint8_t* w_data = w.const_data_ptr<uint8_t>();
  const at::BFloat16* sz_data = sz.const_data_ptr<at::BFloat16>();
  float* out_data = out.data_ptr<float>();
  const int64_t blocks = (out_features + block_n - 1) / block_n;
  // bfloat16 GEMMs for a prefill chunk's rows on AMX (x's values are bfloat16's: the kernels' activations)
  const bool bf16 = rows >= kBf16FromRows && amx_tiles() && in_features % 2 == 0 && out_features % 16 == 0;
  const at::Tensor a16 = bf16 ? a.to(at::kBFloat16) : at::Tensor();  // (no copy where x is bfloat16)
  const at::Tensor a32 = bf16 ? at::Tensor() : a.to(at::kFloat);
  const float* a_data = bf16 ? nullptr : a32.const_data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(in_features * block_n), scale(block_n), zero(block_n);
    std::vector<at::BFloat16> high(bf16 ? in_features * block_n : 0), low(high.size());
    for (int64_t i = begin; i < end; ++i) {
      const int64_t start = i * block_n, width = std::min(block_n, out_features - start);
      dequantise_tile(w_data, sz_data, out_features, in_features, group, start, width, split_halves && width == block_n,
                      tile.data(), scale.data(), zero.data());
#if defined(__AVX512F__)
      if (bf16) {
        split_tile(tile.data(), in_features, width, high.data(), low.data());
        for (const auto* part : {high.data(), low.data()})
          at::native::cpublas::brgemm(rows, width, in_features, in_features, width, out_features, part == low.data(),
                                      a16.const_data_ptr<at::BFloat16>(), part, out_data + start, true);
      } else
#endif
      {
        for (int64_t r = 0; r < rows; r += kRowChunk) {
          at::native::cpublas::brgemm(std::min(kRowChunk, rows - r), width, in_features, in_features, width,
                                      out_features, false, a_data + r * in_features, tile.data(),
                                      out_data + r * out_features + start, false);
        }
      }
      if (round_output) round_to_bf16(out_data + start, rows, width, out_features);  // the tile's, in cache
    }
    at::native::cpublas::brgemm_release(false);
    if (bf16) at::native::cpublas::brgemm_release(true);
  });
  return out;
}

}  // namespace

// x [rows, in] float32 (bfloat16's values: the kernels' activations); packed uint8 [out, in / 2];
// scales_and_zeros bfloat16 [in / group, out, 2]. block_n and split_halves: torch's packing on this CPU
// (above). Returns x @ W.T, float32 [rows, out], unrounded.
at::Tensor int4_tiled_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                             int64_t group, int64_t block_n, bool split_halves) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int4_tiled_matmul: x must be float32 [rows, in]");
  return tiled(x, packed, scales_and_zeros, group, block_n, split_halves, false);
}

// The layer's matmul as a step runs it: x [rows, in] float32 or bfloat16, its values rounded to
// bfloat16 (the kernels' activations), by torch's kernel below `tiled_from_rows` rows, else by the
// tiles. Returns x @ W.T in x's dtype [rows, out], rounded to bfloat16's precision whichever path ran
// it: a float32 model's layers convert nothing more (the tiles take bfloat16 rows and round each tile's
// products in cache).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_and_zeros,
                       int64_t group, int64_t block_n, bool split_halves, int64_t tiled_from_rows) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4_linear: x must be float32 or bfloat16 [rows, in]");
  const at::Tensor x16 = x.to(at::kBFloat16);
  if (x.size(0) < tiled_from_rows)
    return at::_weight_int4pack_mm_for_cpu(x16, packed, group, scales_and_zeros).to(x.scalar_type());
  return tiled(x16, packed, scales_and_zeros, group, block_n, split_halves, true).to(x.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(cortex, m) {
  m.def("int4_tiled_matmul(Tensor x, Tensor packed, Tensor scales_and_zeros, int group, int block_n, bool split_halves) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_and_zeros, int group, int block_n, bool split_halves, int tiled_from_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(cortex, CPU, m) {
  m.impl("int4_tiled_matmul", &int4_tiled_matmul);
  m.impl("int4_linear", &int4_linear);
}
