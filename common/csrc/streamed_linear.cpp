// y = x @ W.T for a few float32 rows x [M, K] and a weight W [N, K], reading W once.
//
// A verify pass on a CPU multiplies every weight matrix by a handful of rows. Up to a dozen or so
// rows the product is bound by reading the weight, not by arithmetic, so it should cost what one
// row costs. Blocks of R weight rows are streamed from memory once (prefetched ahead); for each
// block, the input rows are taken G at a time with R x G accumulators held in AVX-512 registers,
// and a block's later groups find its weight rows still in L1. K must be a multiple of 16.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int R = 3;                 // weight rows a block streams together
constexpr int G = 8;                 // input rows whose accumulators live in registers at once
constexpr int64_t PREFETCH = 256;    // floats ahead of the loads (1 KiB)

template <int M, int RB>
inline void tile(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t n) {
  __m512 acc[RB][M];
  for (int r = 0; r < RB; r++)
    for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[RB];
    for (int r = 0; r < RB; r++) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + r) * K + k + PREFETCH), _MM_HINT_T0);
      wv[r] = _mm512_loadu_ps(w + (n + r) * K + k);
    }
    for (int m = 0; m < M; m++) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < RB; r++) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < RB; r++)
    for (int m = 0; m < M; m++) y[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]);
}

template <int RB>
inline void group(const float* x, int64_t rows, int64_t K, const float* w, float* y, int64_t N, int64_t n) {
  switch (rows) {  // rows <= G
    case 1: tile<1, RB>(x, K, w, y, N, n); break;
    case 2: tile<2, RB>(x, K, w, y, N, n); break;
    case 3: tile<3, RB>(x, K, w, y, N, n); break;
    case 4: tile<4, RB>(x, K, w, y, N, n); break;
    case 5: tile<5, RB>(x, K, w, y, N, n); break;
    case 6: tile<6, RB>(x, K, w, y, N, n); break;
    case 7: tile<7, RB>(x, K, w, y, N, n); break;
    default: tile<8, RB>(x, K, w, y, N, n); break;
  }
}

template <int RB>
inline void block(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t n) {
  for (int64_t m0 = 0; m0 < M; m0 += G)
    group<RB>(x + m0 * K, std::min<int64_t>(G, M - m0), K, w, y + m0 * N, N, n);
}

}  // namespace

torch::Tensor streamed_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "streamed_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "streamed_linear: float32 only");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && weight.is_contiguous(), "streamed_linear: contiguous CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(K % 16 == 0, "streamed_linear: K must be a multiple of 16");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = N / R;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b++) block<R>(xp, M, K, wp, yp, N, b * R);
  });
  for (int64_t n = blocks * R; n < N; n++) block<1>(xp, M, K, wp, yp, N, n);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("streamed_linear", &streamed_linear, "x @ weight.T, the weight read once (float32, AVX-512)");
}
