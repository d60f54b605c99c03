// Attention of a pass's short sequences on their own KV caches, all sequences in one call.
//
// On a CPU the dense backends attend one sequence at a time: a dozen small tensor operations and a
// scaled_dot_product_attention call per sequence and layer, about 60 us each, which is two
// milliseconds per request in a pass of SmolLM2-135M (30 layers), a third of a 16-request pass.
// Here one call per layer does every sequence it is given to attend (in float32 those with a few new
// tokens: a decode step, a draft tree; in bfloat16 prompts too): threads claim (query row, key/value
// head) items (claim_for in vec.h; an item's cost follows its sequence's length, so claiming also
// evens the threads out); each key and value row is read once for the query heads that share it
// (GQA), scores go through a softmax in float32, and each query row is computed alone in a fixed
// order, so its result does not depend on the rows or sequences beside it.
// Items were (sequence, key/value head) before, each a block of its sequence's rows: a pass of one
// request's tree gave two threads three items (SmolLM2's three key/value heads), and the rows' outputs
// were added up in memory key by key. By row, with a row's outputs in registers, its dot products
// four keys at a time and its softmax's maximum by vectors, SmolLM2-135M's attention took 35 us a
// layer for one request's five rows at a 200-token context against 70, 121 for sixteen requests'
// single rows against 178, with every output the same bits (the same operations in the same order
// for each output; the sums of exponentials and of values still go key by key).
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

// q . k over D floats (a multiple of 16) for NK keys at once: per key 16 / W registers of partial
// sums, added in a fixed order, the same operations as for one key alone (so the same bits), with the
// keys' chains of multiply-adds interleaved instead of each waiting on its own latency
template <int NK>
inline void dots(const float* a, const float* const* b, int64_t D, float* out) {
  constexpr int L = LANES / Vec::W;
  typename Vec::T acc[NK][L];
  for (int n = 0; n < NK; n++)
    for (int l = 0; l < L; l++) acc[n][l] = Vec::mul(Vec::load(a + l * Vec::W), Vec::load(b[n] + l * Vec::W));
  for (int64_t d = LANES; d < D; d += LANES)
    for (int n = 0; n < NK; n++)
      for (int l = 0; l < L; l++) acc[n][l] = Vec::fma(Vec::load(a + d + l * Vec::W), Vec::load(b[n] + d + l * Vec::W), acc[n][l]);
  for (int n = 0; n < NK; n++) {
    for (int l = 1; l < L; l++) acc[n][0] = Vec::add(acc[n][0], acc[n][l]);
    out[n] = Vec::sum(acc[n][0]);
  }
}

constexpr int KEYS_AT_ONCE = 4;  // keys whose dot products go together (dots<4>)
constexpr int OUT_VECS = 4;  // output registers per head of a row's weighted sum of values
constexpr int HEADS_AT_ONCE = 4;  // query heads of a key/value head whose outputs are summed together

// Where query row i of a sequence reads its keys and values: the first `past` from the cache (rows
// kv_stride apart), new key j from the pass's own new keys (rows new_stride apart: the values the
// cache receives, so the same bits); row i sees new key j where mask_row[j], an ancestor-or-self
// (j <= i, parents come before their children).
struct RowKeys {
  const float* k;
  const float* v;
  int64_t kv_stride;
  int64_t past;
  const float* k_new;
  const float* v_new;
  int64_t new_stride;
  const bool* mask_row;
  int64_t i;

  const float* key(int64_t j) const { return j < past ? k + j * kv_stride : k_new + (j - past) * new_stride; }
  const float* value(int64_t j) const { return j < past ? v + j * kv_stride : v_new + (j - past) * new_stride; }
};

// The weighted sum of values of NH heads (score rows P apart, outputs D apart) over dims [d, d + NV W):
// each head's registers add its values key by key, j = 0, 1, ..., a key of weight 0 adding nothing.
template <int NH, int NV>
inline void weigh_values(const RowKeys& rk, int64_t S, const float* sc, int64_t P, int64_t D, int64_t d, float* out) {
  typename Vec::T acc[NH][NV];
  for (int h = 0; h < NH; h++)
    for (int l = 0; l < NV; l++) acc[h][l] = Vec::zero();
  for (int64_t j = 0; j < S; j++) {
    const float* vj = rk.value(j) + d;
    typename Vec::T vv[NV];
    for (int l = 0; l < NV; l++) vv[l] = Vec::load(vj + l * Vec::W);
    for (int h = 0; h < NH; h++) {
      const float p = sc[h * P + j];
      if (p == 0.f) continue;
      const Vec::T vp = Vec::set1(p);
      for (int l = 0; l < NV; l++) acc[h][l] = Vec::fma(vp, vv[l], acc[h][l]);
    }
  }
  for (int h = 0; h < NH; h++)
    for (int l = 0; l < NV; l++) Vec::store(out + h * D + d + l * Vec::W, acc[h][l]);
}

// Row i for the `rep` query heads that share one key/value head (q and out: the first head's D
// floats, heads D apart). Each (row, head) computes its scores over the keys it sees, a softmax in
// float32 (exponentials lane by lane, their sum key by key), and its output as the values' weighted
// sum key by key, j = 0, 1, ... (a masked key adds nothing), in registers; its result depends on its
// own query, keys and values only, never on the rows, heads or sequences beside it. Each key and
// value row is read once for all the heads.
void attend_row(const float* q, int rep, const RowKeys& rk, int64_t D, float scale, float* out,
                std::vector<float>& scores, std::vector<int64_t>& seen) {
  const int64_t S = rk.past + rk.i + 1;
  const int64_t P = (S + Vec::W - 1) / Vec::W * Vec::W;  // a score row padded with -inf to whole vectors
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // the keys it sees, x = 0, 1, ...: every cached one, then the new ones its mask allows
  seen.clear();
  for (int64_t j = 0; j <= rk.i; j++)
    if (rk.mask_row[j]) seen.push_back(rk.past + j);
  const auto seen_key = [&](int64_t x) { return x < rk.past ? x : seen[x - rk.past]; };
  scores.assign(static_cast<size_t>(rep) * P, neg_inf);
  const int64_t n_seen = rk.past + static_cast<int64_t>(seen.size());
  int64_t x = 0;
  for (; x + KEYS_AT_ONCE <= n_seen; x += KEYS_AT_ONCE) {
    int64_t js[KEYS_AT_ONCE];
    const float* ks[KEYS_AT_ONCE];
    for (int n = 0; n < KEYS_AT_ONCE; n++) ks[n] = rk.key(js[n] = seen_key(x + n));
    for (int r = 0; r < rep; r++) {
      float got[KEYS_AT_ONCE];
      dots<KEYS_AT_ONCE>(q + r * D, ks, D, got);
      float* sc = scores.data() + r * P;
      for (int n = 0; n < KEYS_AT_ONCE; n++) sc[js[n]] = got[n] * scale;
    }
  }
  for (; x < n_seen; x++) {
    const int64_t j = seen_key(x);
    const float* kx = rk.key(j);
    for (int r = 0; r < rep; r++) {
      float got;
      dots<1>(q + r * D, &kx, D, &got);
      scores[r * P + j] = got * scale;
    }
  }
  for (int r = 0; r < rep; r++) {  // exponentials of the scores less their maximum (a maximum needs no order)
    float* sc = scores.data() + r * P;
    Vec::T vmax = Vec::load(sc);
    for (int64_t j = Vec::W; j < P; j += Vec::W) vmax = Vec::max(vmax, Vec::load(sc + j));
    const Vec::T vm = Vec::set1(Vec::max_of(vmax));
    for (int64_t j = 0; j < P; j += Vec::W) {
      const Vec::T s = Vec::load(sc + j);
      Vec::store(sc + j, Vec::zero_where_neg_inf(s, cosine_kernels::exp_neg(Vec::sub(s, vm))));
    }
  }
  for (int r0 = 0; r0 < rep; r0 += HEADS_AT_ONCE) {  // each head's sum key by key, the heads' chains side by side
    const int nh = static_cast<int>(std::min<int64_t>(HEADS_AT_ONCE, rep - r0));
    float sum[HEADS_AT_ONCE] = {};
    const float* sc = scores.data() + r0 * P;
    for (int64_t j = 0; j < S; j++)
      for (int h = 0; h < nh; h++) sum[h] += sc[h * P + j];
    for (int h = 0; h < nh; h++) {
      float* row = scores.data() + (r0 + h) * P;
      const Vec::T inv = Vec::set1(1.f / sum[h]);
      for (int64_t j = 0; j < P; j += Vec::W) Vec::store(row + j, Vec::mul(Vec::load(row + j), inv));
    }
  }
  for (int r0 = 0; r0 < rep; r0 += HEADS_AT_ONCE) {
    const float* sc = scores.data() + r0 * P;
    float* o = out + r0 * D;
    cosine_kernels::with_rows<HEADS_AT_ONCE>(std::min<int64_t>(HEADS_AT_ONCE, rep - r0), [&](auto nh) {
      constexpr int NH = decltype(nh)::value;
      int64_t d = 0;
      for (; d + OUT_VECS * Vec::W <= D; d += OUT_VECS * Vec::W) weigh_values<NH, OUT_VECS>(rk, S, sc, P, D, d, o);
      for (; d < D; d += Vec::W) weigh_values<NH, 1>(rk, S, sc, P, D, d, o);
    });
  }
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
  // one item per (row, key/value head): it writes that row's new key and value for the head into its
  // sequence's cache, then (for a sequence the kernel attends) attends the row's query heads that
  // share the head, reading the pass's new keys from k_new, v_new (never from a cache slot another
  // item writes). Rows, not sequences, so that a pass of one sequence's few rows keeps every thread busy.
  std::vector<int64_t> row_seq(static_cast<size_t>(N), -1);
  for (int64_t b = 0; b < B; b++)
    for (int64_t i = 0; i < lens[b]; i++) row_seq[offsets[b] + i] = b;
  claim_for(N * Hkv, [&](int64_t it) {
    thread_local std::vector<float> scores;
    thread_local std::vector<int64_t> seen;
    const int64_t row = it / Hkv, g = it % Hkv, b = row_seq[row];
    if (b < 0) return;  // a row no sequence claims
    const int64_t t = lens[b], S = ks[b].size(1), past = S - t, i = row - offsets[b];
    float* k = ks[b].data_ptr<float>() + g * ks[b].stride(0);
    float* v = vs[b].data_ptr<float>() + g * vs[b].stride(0);
    const int64_t from = (row * Hkv + g) * D, to = (past + i) * ks[b].stride(1);
    std::copy(kn + from, kn + from + D, k + to);
    std::copy(vn + from, vn + from + D, v + to);
    if (!attend[b]) return;
    const int64_t first_new = (offsets[b] * Hkv + g) * D;
    const RowKeys rk{k, v, ks[b].stride(1), past, kn + first_new, vn + first_new, Hkv * D, mp + mask_offsets[b] + i * t, i};
    const int64_t at = (row * H + g * rep) * D;  // row `row`, head g * rep; rows H * D apart
    attend_row(qp + at, rep, rk, D, sc, op + at, scores, seen);
  });
}
