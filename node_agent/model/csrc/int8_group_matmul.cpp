// A layer of 8-bit codes with a scale per group of 32 inputs (GGUF's Q8_0: w = scale * q) on a CPU
// (node_agent/model/int8_groups_cpu.py), read as it is stored: a byte a weight. The output head of
// most GGUF files is kept this way (the embedding it is tied to), and at one decode row reading it
// is a third of the step's bytes; torch has no kernel for groups of 8-bit codes.
//
// The codes are laid out channel-inner, blocks of 64 output channels: codes [blocks, in, 64],
// scales [blocks, in / group, 64] float32 (layers of whole blocks only). Few rows: each
// block's 64 channels summed in registers over the input, a group at a time, then scaled into the
// block's sums (the codes converted once for all the rows). Many rows: a block dequantised into
// float32 [in, 64] in the thread's cache and multiplied by all the rows with oneDNN's batch-reduce
// GEMM (ATen's cpublas::brgemm), as the 4-bit tiles do (int4_matmul.cpp).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <vector>

namespace {

constexpr int64_t kBlock = 64;     // output channels a block
constexpr int64_t kFewRows = 4;    // rows summed in registers; more run the dequantised tiles
constexpr int64_t kRowChunk = 64;  // rows a GEMM call takes

// out[r, n] for rows r < ROWS and the 64 channels n of one block.
template <int ROWS>
void block_few_rows(const float* x, int64_t in_features, int64_t group, const int8_t* codes, const float* scales,
                    float* out, int64_t out_stride) {
#if defined(__AVX512F__)
  __m512 sum[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) sum[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < in_features / group; ++g) {
    __m512 part[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < 4; ++j) part[r][j] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      const int8_t* row = codes + k * kBlock;
      __m512 w[4];
      for (int j = 0; j < 4; ++j)
        w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j))));
      for (int r = 0; r < ROWS; ++r) {
        const __m512 xk = _mm512_set1_ps(x[r * in_features + k]);
        for (int j = 0; j < 4; ++j) part[r][j] = _mm512_fmadd_ps(w[j], xk, part[r][j]);
      }
    }
    const float* scale = scales + g * kBlock;
    for (int j = 0; j < 4; ++j) {
      const __m512 s = _mm512_loadu_ps(scale + 16 * j);
      for (int r = 0; r < ROWS; ++r) sum[r][j] = _mm512_fmadd_ps(part[r][j], s, sum[r][j]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * out_stride + 16 * j, sum[r][j]);
#else  // plain loops (the compiler vectorises them as it can)
  float sum[ROWS][kBlock] = {}, part[ROWS][kBlock];
  for (int64_t g = 0; g < in_features / group; ++g) {
    std::fill(&part[0][0], &part[0][0] + ROWS * kBlock, 0.0f);
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      const int8_t* row = codes + k * kBlock;
      for (int r = 0; r < ROWS; ++r) {
        const float xk = x[r * in_features + k];
        for (int64_t n = 0; n < kBlock; ++n) part[r][n] += static_cast<float>(row[n]) * xk;
      }
    }
    const float* scale = scales + g * kBlock;
    for (int r = 0; r < ROWS; ++r)
      for (int64_t n = 0; n < kBlock; ++n) sum[r][n] += part[r][n] * scale[n];
  }
  for (int r = 0; r < ROWS; ++r) std::copy(sum[r], sum[r] + kBlock, out + r * out_stride);
#endif
}

// One block as float32 [in, 64] (row k: input k's weights).
void dequantise_block(int64_t in_features, int64_t group, const int8_t* codes, const float* scales,
                      float* __restrict__ tile) {
  for (int64_t k = 0; k < in_features; ++k) {
    const int8_t* row = codes + k * kBlock;
    const float* scale = scales + (k / group) * kBlock;
    float* into = tile + k * kBlock;
#if defined(__AVX512F__)
    for (int j = 0; j < 4; ++j) {
      const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j))));
      _mm512_storeu_ps(into + 16 * j, _mm512_mul_ps(w, _mm512_loadu_ps(scale + 16 * j)));
    }
#else
    for (int64_t n = 0; n < kBlock; ++n) into[n] = static_cast<float>(row[n]) * scale[n];
#endif
  }
}

}  // namespace

// x [rows, in] float32; codes int8 [blocks, in, 64]; scales float32 [blocks, in / group, 64].
// Returns x @ W.T, float32 [rows, out_features] (out_features = blocks * 64).
at::Tensor int8_group_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_group_matmul: x must be float32 [rows, in]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kChar && codes.size(2) == kBlock,
              "int8_group_matmul: codes must be int8 [blocks, in, ", kBlock, "]");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.size(0) == codes.size(0) &&
                  scales.size(2) == kBlock,
              "int8_group_matmul: scales must be float32 [blocks, in / group, ", kBlock, "]");
  const at::Tensor a = x.contiguous(), c = codes.contiguous(), s = scales.contiguous();
  const int64_t rows = a.size(0), in_features = a.size(1), blocks = c.size(0);
  TORCH_CHECK(c.size(1) == in_features && in_features % s.size(1) == 0, "int8_group_matmul: ", in_features,
              " inputs against codes of ", c.size(1), " and ", s.size(1), " groups");
  TORCH_CHECK(out_features == blocks * kBlock, "int8_group_matmul: ", out_features, " outputs in ", blocks, " blocks");
  const int64_t group = in_features / s.size(1);
  at::Tensor out = at::empty({rows, out_features}, a.options());
  const float* a_data = a.const_data_ptr<float>();
  const int8_t* c_data = c.const_data_ptr<int8_t>();
  const float* s_data = s.const_data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(rows >= kFewRows ? in_features * kBlock : 0);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = b * kBlock;
      const int8_t* block_codes = c_data + b * in_features * kBlock;
      const float* block_scales = s_data + b * (in_features / group) * kBlock;
      if (rows < kFewRows) {
        for (int64_t r = 0; r < rows;) {
          const float* xr = a_data + r * in_features;
          float* o = out_data + r * out_features + start;
          switch (rows - r) {
            case 3: block_few_rows<3>(xr, in_features, group, block_codes, block_scales, o, out_features); r += 3; break;
            case 2: block_few_rows<2>(xr, in_features, group, block_codes, block_scales, o, out_features); r += 2; break;
            default: block_few_rows<1>(xr, in_features, group, block_codes, block_scales, o, out_features); r += 1;
          }
        }
        continue;
      }
      dequantise_block(in_features, group, block_codes, block_scales, tile.data());
      for (int64_t r = 0; r < rows; r += kRowChunk) {
        at::native::cpublas::brgemm(std::min(kRowChunk, rows - r), kBlock, in_features, in_features, kBlock,
                                    out_features, false, a_data + r * in_features, tile.data(),
                                    out_data + r * out_features + start, false);
      }
    }
    if (rows >= kFewRows) at::native::cpublas::brgemm_release(false);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(cortex, m) {
  m.def("int8_group_matmul(Tensor x, Tensor codes, Tensor scales, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(cortex, CPU, m) { m.impl("int8_group_matmul", &int8_group_matmul); }
