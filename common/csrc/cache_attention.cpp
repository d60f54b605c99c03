// Attention of a pass's short sequences on their own KV caches, all sequences in one call.
//
// On a CPU the dense backends attend one sequence at a time: a dozen small tensor operations and a
// scaled_dot_product_attention call per sequence and layer, about 60 us each, which is two
// milliseconds per request in a pass of SmolLM2-135M (30 layers), a third of a 16-request pass.
// Here one call per layer does every sequence it is given to attend (in float32 those with a few new
// tokens: a decode step, a draft tree; in bfloat16 prompts too): threads claim (sequence, key/value
// head) items (claim_for in vec.h; an item's cost follows its sequence's length, so claiming also
// evens the threads out); each key and value row is read once for the query heads that share it
// (GQA), scores go through a softmax in float32, and each query row is computed alone in a fixed
// order, so its result does not depend on the rows or sequences beside it.
// The queries of sequence b (rows offsets[b] .. offsets[b] + t_b of q) attend to the first
// S_b - t_b keys (its cache) and to its new keys j where mask[i, j] (ancestors-or-self).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using cosine_kernels::Vec;
using cosine_kernels::claim_for;

constexpr int LANES = 16;  // head_dim steps by 16 floats

// q . k over D floats (a multiple of 16): 16 / W registers of partial sums, added in a fixed order
inline float dot(const float* a, const float* b, int64_t D) {
  constexpr int L = LANES / Vec::W;
  typename Vec::T acc[L];
  for (int l = 0; l < L; l++) acc[l] = Vec::mul(Vec::load(a + l * Vec::W), Vec::load(b + l * Vec::W));
  for (int64_t d = LANES; d < D; d += LANES)
    for (int l = 0; l < L; l++) acc[l] = Vec::fma(Vec::load(a + d + l * Vec::W), Vec::load(b + d + l * Vec::W), acc[l]);
  for (int l = 1; l < L; l++) acc[0] = Vec::add(acc[0], acc[l]);
  return Vec::sum(acc[0]);
}

// Rows i0 .. i1 of attend_rows (below): they see the keys up to past + i1 at most (new key j needs
// j <= i). Exponentials and the weighted values go lane by lane (a lane's result depends on its own
// inputs only); a row's sum of exponentials is added key by key.
void attend_block(const float* q, int64_t q_stride_row, int rep, const float* k, const float* v, int64_t kv_stride_s,
                  int64_t past, int64_t t, int64_t i0, int64_t i1, const bool* mask, int64_t D, float scale, float* out,
                  std::vector<float>& scores) {
  const int64_t S = past + i1, R = (i1 - i0) * rep;  // R score rows: (row i, head r) at (i - i0) * rep + r
  const int64_t P = (S + Vec::W - 1) / Vec::W * Vec::W;  // a score row padded with -inf to whole vectors
  scores.resize(static_cast<size_t>(R) * P);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < S; j++) {
    const float* kj = k + j * kv_stride_s;
    for (int64_t i = i0; i < i1; i++) {
      const bool allowed = j < past || mask[i * t + (j - past)];
      for (int r = 0; r < rep; r++)
        scores[((i - i0) * rep + r) * P + j] = allowed ? dot(q + i * q_stride_row + r * D, kj, D) * scale : neg_inf;
    }
  }
  for (int64_t x = 0; x < R; x++) {
    float* sc = scores.data() + x * P;
    std::fill(sc + S, sc + P, neg_inf);
    float m = neg_inf;
    for (int64_t j = 0; j < S; j++) m = std::max(m, sc[j]);
    const Vec::T vm = Vec::set1(m);
    for (int64_t j = 0; j < P; j += Vec::W) {
      const Vec::T s = Vec::load(sc + j);
      Vec::store(sc + j, Vec::zero_where_neg_inf(s, cosine_kernels::exp_neg(Vec::sub(s, vm))));
    }
    float sum = 0.f;
    for (int64_t j = 0; j < S; j++) sum += sc[j];
    const Vec::T inv = Vec::set1(1.f / sum);
    for (int64_t j = 0; j < P; j += Vec::W) Vec::store(sc + j, Vec::mul(Vec::load(sc + j), inv));
  }
  for (int64_t i = i0; i < i1; i++)
    for (int r = 0; r < rep; r++) std::fill(out + i * q_stride_row + r * D, out + i * q_stride_row + (r + 1) * D, 0.f);
  for (int64_t j = 0; j < S; j++) {
    const float* vj = v + j * kv_stride_s;
    for (int64_t i = i0; i < i1; i++)
      for (int r = 0; r < rep; r++) {
        const float p = scores[((i - i0) * rep + r) * P + j];
        if (p == 0.f) continue;
        float* o = out + i * q_stride_row + r * D;
        const Vec::T vp = Vec::set1(p);
        for (int64_t d = 0; d < D; d += Vec::W) Vec::store(o + d, Vec::fma(vp, Vec::load(vj + d), Vec::load(o + d)));
      }
  }
}

constexpr int64_t ROW_BLOCK = 32;

// Every query row (t of them) of sequence b for the `rep` query heads of key/value head g: each key
// and value row is read once for all of a block's rows. Row i sees the first `past` keys and new key
// j where mask[i * t + j]; each (row, head) sums its scores and values over the keys in order j = 0,
// 1, ... (a masked key adds nothing), as the same row alone would. Rows go in blocks of ROW_BLOCK (a
// prompt's rows too), so a block's scores stay small; a row's result does not depend on its block.
void attend_rows(const float* q, int64_t q_stride_row, int rep, const float* k, const float* v, int64_t kv_stride_s,
                 int64_t past, int64_t t, const bool* mask, int64_t D, float scale, float* out, std::vector<float>& scores) {
  for (int64_t i0 = 0; i0 < t; i0 += ROW_BLOCK)
    attend_block(q, q_stride_row, rep, k, v, kv_stride_s, past, t, i0, std::min(t, i0 + ROW_BLOCK), mask, D, scale, out, scores);
}

}  // namespace

// Writes every sequence's new keys and values (rows offsets[b] .. + lens[b] of k_new, v_new [N, Hkv, D])
// into the last lens[b] slots of its ks[b], vs[b] ([Hkv, S_b, D] views of its cache), then attends
// the sequences with attend[b] (their masks at mask_offsets[b], t_b x t_b row-major) into out's rows.
void cache_attention(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                     const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
                     const std::vector<int64_t>& offsets, const std::vector<int64_t>& lens, const std::vector<bool>& attend,
                     const torch::Tensor& mask, const std::vector<int64_t>& mask_offsets, double scale, torch::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat && q.device().is_cpu(),
              "cache_attention: q must be a contiguous float32 CPU tensor [N, H, D]");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat, "cache_attention: out like q");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous(), "cache_attention: mask must be a contiguous bool tensor");
  const int64_t B = static_cast<int64_t>(ks.size());
  TORCH_CHECK(static_cast<int64_t>(vs.size()) == B && static_cast<int64_t>(offsets.size()) == B && static_cast<int64_t>(lens.size()) == B &&
              static_cast<int64_t>(attend.size()) == B && static_cast<int64_t>(mask_offsets.size()) == B,
              "cache_attention: one key, value, offset, length, attend flag and mask offset per sequence");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(D % LANES == 0, "cache_attention: head_dim must be a multiple of 16");
  if (B == 0) return;
  const int64_t Hkv = ks[0].size(0);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "cache_attention: query heads must be a multiple of key/value heads");
  for (const auto* t : {&k_new, &v_new})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == N && t->size(1) == Hkv && t->size(2) == D && t->is_contiguous() &&
                t->scalar_type() == at::kFloat, "cache_attention: new keys and values [N, Hkv, D], contiguous float32");
  for (int64_t b = 0; b < B; b++) {
    const auto& k = ks[b];
    const auto& v = vs[b];
    TORCH_CHECK(k.dim() == 3 && k.size(0) == Hkv && k.size(2) == D && k.stride(2) == 1 && k.scalar_type() == at::kFloat && k.device().is_cpu(),
                "cache_attention: keys [Hkv, S, D], float32 on the CPU, rows contiguous");
    TORCH_CHECK(v.sizes() == k.sizes() && v.strides() == k.strides() && v.scalar_type() == at::kFloat,
                "cache_attention: values shaped and strided as the keys");
    TORCH_CHECK(lens[b] >= 1 && offsets[b] >= 0 && offsets[b] + lens[b] <= N && lens[b] <= k.size(1), "cache_attention: rows out of range");
    TORCH_CHECK(!attend[b] || (mask_offsets[b] >= 0 && mask_offsets[b] + lens[b] * lens[b] <= mask.numel()), "cache_attention: mask too short");
  }
  const float* kn = k_new.data_ptr<float>();
  const float* vn = v_new.data_ptr<float>();
  const int rep = static_cast<int>(H / Hkv);
  const float* qp = q.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // one item per (sequence, key/value head): it writes that head's new keys and values, then (for a
  // sequence the kernel attends) attends that head's query rows
  claim_for(B * Hkv, [&](int64_t it) {
    thread_local std::vector<float> scores;
    const int64_t b = it / Hkv, g = it % Hkv;
    const int64_t t = lens[b], S = ks[b].size(1), past = S - t;
    float* k = ks[b].data_ptr<float>() + g * ks[b].stride(0);
    float* v = vs[b].data_ptr<float>() + g * vs[b].stride(0);
    for (int64_t i = 0; i < t; i++) {
      const int64_t from = ((offsets[b] + i) * Hkv + g) * D, to = (past + i) * ks[b].stride(1);
      std::copy(kn + from, kn + from + D, k + to);
      std::copy(vn + from, vn + from + D, v + to);
    }
    if (!attend[b]) return;
    const int64_t first = (offsets[b] * H + g * rep) * D;  // row offsets[b], head g * rep; rows H * D apart
    attend_rows(qp + first, H * D, rep, k, v, ks[b].stride(1), past, t, mp + mask_offsets[b], D, sc, op + first, scores);
  });
}
