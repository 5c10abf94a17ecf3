// LoRA adapters' updates on a CPU (node_agent/model/lora_layers.py): each token's own adapter's
// low-rank update, B @ (A @ x), added in place to what the base layer gave, one call a layer for the
// whole batch. The tokens are grouped by adapter slot and taken kBlock at a time, so each adapter's
// matrices are read once a block (from memory for a slot's first block, then from the shared cache);
// tokens of slot 0 (the base) are left alone. No token does another adapter's work: a batched matmul
// over every slot's columns, masked, does `slots` times the work, in a dozen calls a layer. Decoding,
// the call is bound by reading the adapters' matrices (~8 GB/s on a 2-core EPYC: 4 rank-16 adapters
// on every projection of SmolLM2-135M, float32, are 78 MB a step, ~10 ms).
//
// a: [slots, parts * rank, in] (each part's A rows, one after another); bts: a tensor a part,
// [slots, rank, width] (its B transposed, scaled); out: [tokens, sum of widths], the parts side by
// side; x: [tokens, in]; token_slots: [tokens] int64, 0 the base, 1..slots the adapters.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kBlock = 4;  // tokens of one slot done together (4 sums in registers: a weight loaded once for them)
constexpr int64_t kTile = 64;  // output columns summed in registers for a block's tokens (16 AVX-512 vectors)

// The adapters' tokens, `order` grouped by slot: slot `slots[g]`'s are order[starts[g] .. starts[g + 1]).
struct Groups {
  std::vector<int64_t> order, starts, slots;
};

// For each block of up to kBlock tokens of one slot (`inputs`: the tokens' rows in `order`'s order,
// as float32): low = A @ x, then out[token, each part's columns] += low[part's rank] @ B.T.
template <typename T>
void add_updates(const Groups& groups, const std::vector<float>& inputs, const T* a, int64_t in_features,
                 const std::vector<const T*>& bts, const std::vector<int64_t>& widths, int64_t rank, T* out,
                 int64_t out_features) {
  const int64_t parts = static_cast<int64_t>(widths.size()), columns = parts * rank;
  std::vector<int64_t> block_first, block_group;
  for (size_t g = 0; g < groups.slots.size(); ++g)
    for (int64_t t = groups.starts[g]; t < groups.starts[g + 1]; t += kBlock) {
      block_first.push_back(t);
      block_group.push_back(static_cast<int64_t>(g));
    }
  at::parallel_for(0, static_cast<int64_t>(block_first.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> low(kBlock * columns);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t group = block_group[block], first = block_first[block], slot = groups.slots[group];
      const int64_t count = std::min(kBlock, groups.starts[group + 1] - first);
      const float* x0 = inputs.data() + first * in_features;  // a short block reads its first token again
      const float *x1 = count > 1 ? x0 + in_features : x0, *x2 = count > 2 ? x0 + 2 * in_features : x0,
                  *x3 = count > 3 ? x0 + 3 * in_features : x0;
      const T* slot_a = a + (slot - 1) * columns * in_features;
      for (int64_t j = 0; j < columns; ++j) {
        const T* a_row = slot_a + j * in_features;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
        for (int64_t i = 0; i < in_features; ++i) {
          const float w = static_cast<float>(a_row[i]);
          s0 += w * x0[i];
          s1 += w * x1[i];
          s2 += w * x2[i];
          s3 += w * x3[i];
        }
        low[j] = s0;
        low[columns + j] = s1;
        low[2 * columns + j] = s2;
        low[3 * columns + j] = s3;
      }
      int64_t offset = 0;  // the part's first column in out
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t width = widths[part];
        const T* slot_bt = bts[part] + (slot - 1) * rank * width;
        for (int64_t c0 = 0; c0 < width; c0 += kTile) {
          const int64_t span = std::min(kTile, width - c0);
          float sums[kBlock][kTile] = {};
          for (int64_t j = 0; j < rank; ++j) {
            const T* b_row = slot_bt + j * width + c0;
            float b[kTile];
            if (span == kTile) {  // (a whole tile's loop without a test a column, vectorised)
              for (int64_t c = 0; c < kTile; ++c) b[c] = static_cast<float>(b_row[c]);
            } else {
              for (int64_t c = 0; c < kTile; ++c) b[c] = c < span ? static_cast<float>(b_row[c]) : 0.f;
            }
            for (int64_t k = 0; k < kBlock; ++k) {
              const float l = low[k * columns + part * rank + j];
              for (int64_t c = 0; c < kTile; ++c) sums[k][c] += l * b[c];
            }
          }
          for (int64_t k = 0; k < count; ++k) {
            T* out_row = out + groups.order[first + k] * out_features + offset + c0;
            for (int64_t c = 0; c < span; ++c) out_row[c] = static_cast<T>(static_cast<float>(out_row[c]) + sums[k][c]);
          }
        }
        offset += width;
      }
    }
  });
}

}  // namespace

void lora_update(at::Tensor& out, const at::Tensor& x, const at::Tensor& token_slots, const at::Tensor& a,
                 at::TensorList bts, int64_t rank) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && x.dim() == 2 && token_slots.dim() == 1 && a.dim() == 3,
              "lora_update: out [tokens, out] contiguous, x [tokens, in], token_slots [tokens], a [slots, columns, in]");
  const int64_t tokens = x.size(0), in_features = x.size(1), adapters = a.size(0);
  TORCH_CHECK(out.size(0) == tokens && token_slots.size(0) == tokens && a.size(2) == in_features,
              "lora_update: ", tokens, " tokens of ", in_features, " inputs, out ", out.sizes(), ", a ", a.sizes(),
              ", token_slots ", token_slots.sizes());
  TORCH_CHECK(a.size(1) == static_cast<int64_t>(bts.size()) * rank, "lora_update: a's ", a.size(1),
              " rows for ", bts.size(), " parts of rank ", rank);
  std::vector<int64_t> widths;
  for (const at::Tensor& bt : bts) {
    TORCH_CHECK(bt.dim() == 3 && bt.size(0) == adapters && bt.size(1) == rank && bt.scalar_type() == a.scalar_type(),
                "lora_update: a part's B [", adapters, ", ", rank, ", width], got ", bt.sizes());
    widths.push_back(bt.size(2));
  }
  int64_t total = 0;
  for (int64_t width : widths) total += width;
  TORCH_CHECK(out.size(1) == total, "lora_update: out has ", out.size(1), " columns, the parts ", total);
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && a.scalar_type() == x.scalar_type(),
              "lora_update: out, x and the adapters in one dtype");
  const at::Tensor slots = token_slots.to(at::kLong).contiguous();
  const int64_t* slot_of = slots.const_data_ptr<int64_t>();
  std::vector<int64_t> counts(adapters + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot_of[t] >= 0 && slot_of[t] <= adapters, "lora_update: slot ", slot_of[t], " of ", adapters);
    ++counts[slot_of[t]];
  }
  Groups groups;
  std::vector<int64_t> next(adapters + 1, 0);
  for (int64_t s = 1, position = 0; s <= adapters; position += counts[s++]) {
    next[s] = position;
    if (counts[s] > 0) {
      groups.starts.push_back(position);
      groups.slots.push_back(s);
    }
  }
  groups.order.resize(tokens - counts[0]);
  groups.starts.push_back(static_cast<int64_t>(groups.order.size()));
  if (groups.slots.empty()) return;
  for (int64_t t = 0; t < tokens; ++t)
    if (slot_of[t] > 0) groups.order[next[slot_of[t]]++] = t;
  const at::Tensor rows = x.contiguous(), a_rows = a.contiguous();
  std::vector<at::Tensor> kept;
  for (const at::Tensor& bt : bts) kept.push_back(bt.contiguous());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_update", [&] {
    const scalar_t* x_data = rows.const_data_ptr<scalar_t>();
    std::vector<float> inputs(groups.order.size() * in_features);
    for (size_t t = 0; t < groups.order.size(); ++t)
      for (int64_t i = 0; i < in_features; ++i)
        inputs[t * in_features + i] = static_cast<float>(x_data[groups.order[t] * in_features + i]);
    std::vector<const scalar_t*> bt_data;
    for (const at::Tensor& bt : kept) bt_data.push_back(bt.const_data_ptr<scalar_t>());
    add_updates<scalar_t>(groups, inputs, a_rows.const_data_ptr<scalar_t>(), in_features, bt_data, widths, rank,
                          out.data_ptr<scalar_t>(), out.size(1));
  });
}

TORCH_LIBRARY_FRAGMENT(cortex, m) {
  m.def("lora_update(Tensor(a!) out, Tensor x, Tensor token_slots, Tensor a, Tensor[] bts, int rank) -> ()");
}

TORCH_LIBRARY_IMPL(cortex, CPU, m) { m.impl("lora_update", &lora_update); }
