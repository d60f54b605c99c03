// One vector register of floats for the project's CPU kernels, and the instruction set it is
// compiled for (-march=native picks AVX-512 where the CPU has it, else AVX2 with FMA), plus the
// dispatch from a run-time row count to a kernel compiled for exactly that many rows, and the way
// every kernel hands its items to its threads (claim_for).
#pragma once

#include <immintrin.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace cosine_kernels {

#if defined(__AVX512F__)
constexpr const char* ISA = "avx512";
struct Vec {
  using T = __m512;
  static constexpr int W = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
  static float max_of(T v) { return _mm512_reduce_max_ps(v); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T floor(T v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static T pow2(T n) {  // 2^n for integral n in [-126, 127]
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T zero_where_neg_inf(T x, T v) {  // v, with 0 in the lanes where x is -inf
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-__builtin_inff()), _CMP_NEQ_OQ), v);
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* ISA = "avx2";
struct Vec {
  using T = __m256;
  static constexpr int W = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(T v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static float max_of(T v) {
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  }
  static T floor(T v) { return _mm256_floor_ps(v); }
  static T pow2(T n) {  // 2^n for integral n in [-126, 127]
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T zero_where_neg_inf(T x, T v) {  // v, with 0 in the lanes where x is -inf
    return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-__builtin_inff()), _CMP_NEQ_OQ), v);
  }
};
#else
#error "the project's CPU kernels need AVX-512 or AVX2 with FMA"
#endif

// e^x lane by lane for x <= 0 (a softmax's shifted scores; below -87 it gives e^-87): x = n ln 2 + r
// with |r| <= ln 2 / 2, e^r by a degree-7 polynomial (Cephes' expf coefficients), times 2^n; each
// lane's result depends on its own input only.
inline Vec::T exp_neg(Vec::T x) {
  x = Vec::max(x, Vec::set1(-87.0f));
  const Vec::T n = Vec::floor(Vec::fma(x, Vec::set1(1.44269504088896341f), Vec::set1(0.5f)));
  Vec::T r = Vec::fma(n, Vec::set1(-0.693359375f), x);
  r = Vec::fma(n, Vec::set1(2.12194440e-4f), r);
  Vec::T y = Vec::set1(1.9875691500e-4f);
  y = Vec::fma(y, r, Vec::set1(1.3981999507e-3f));
  y = Vec::fma(y, r, Vec::set1(8.3334519073e-3f));
  y = Vec::fma(y, r, Vec::set1(4.1665795894e-2f));
  y = Vec::fma(y, r, Vec::set1(1.6666665459e-1f));
  y = Vec::fma(y, r, Vec::set1(5.0000001201e-1f));
  y = Vec::fma(y, Vec::mul(r, r), Vec::add(r, Vec::set1(1.0f)));
  return Vec::mul(y, Vec::pow2(n));
}

// f(std::integral_constant<int, rows>) for 1 <= rows <= M: a kernel templated on its row count.
template <int M, class F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (M > 1) {
    if (rows < M) return with_rows<M - 1>(rows, f);
  }
  f(std::integral_constant<int, M>{});
}

// f(i) for every i in [0, n), each thread first taking its own contiguous share from the front (as
// a fixed split would: memory read in long streams, claims on a cache line of its own) and, once
// its share is done, taking items from the back of the share with the most left. A serving process
// shares its cores with others (the router, the gateway, the drafters): with a fixed split a pass
// waits for the thread another process preempted, so a few percent of someone else's CPU can cost
// it twice as much; here the running thread takes over the preempted one's items. Which thread
// computes an item never changes its bits.
struct alignas(64) Share {
  std::atomic<uint64_t> span;  // the items not yet taken, [lo, hi), as lo | hi << 32 (a kernel has far fewer than 2^32)
};

inline uint64_t span_of(int64_t lo, int64_t hi) { return static_cast<uint64_t>(lo) | (static_cast<uint64_t>(hi) << 32); }
inline int64_t span_lo(uint64_t s) { return static_cast<int64_t>(s & 0xffffffffu); }
inline int64_t span_hi(uint64_t s) { return static_cast<int64_t>(s >> 32); }

template <class F>
inline void claim_for(int64_t n, const F& f) {
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  if (threads <= 1) {
    for (int64_t i = 0; i < n; i++) f(i);
    return;
  }
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; t++) shares[t].span.store(span_of(t * n / threads, (t + 1) * n / threads), std::memory_order_relaxed);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {  // own shares, from the front, in runs of a quarter of what is left
      uint64_t s = shares[t].span.load(std::memory_order_relaxed);
      while (span_lo(s) < span_hi(s)) {
        const int64_t lo = span_lo(s), hi = span_hi(s), run = std::max<int64_t>(1, (hi - lo) / 4);
        if (!shares[t].span.compare_exchange_weak(s, span_of(lo + run, hi), std::memory_order_relaxed)) continue;
        for (int64_t i = lo; i < lo + run; i++) f(i);
        s = shares[t].span.load(std::memory_order_relaxed);
      }
    }
    for (;;) {  // then the back half of the share with the most left
      int64_t victim = -1, most = 0;
      for (int64_t t = 0; t < threads; t++) {
        const uint64_t s = shares[t].span.load(std::memory_order_relaxed);
        if (span_hi(s) - span_lo(s) > most) victim = t, most = span_hi(s) - span_lo(s);
      }
      if (victim < 0) return;
      uint64_t s = shares[victim].span.load(std::memory_order_relaxed);
      const int64_t lo = span_lo(s), hi = span_hi(s);
      if (lo >= hi) continue;
      const int64_t run = std::max<int64_t>(1, (hi - lo) / 2);
      if (!shares[victim].span.compare_exchange_weak(s, span_of(lo, hi - run), std::memory_order_relaxed)) continue;
      for (int64_t i = hi - run; i < hi; i++) f(i);
    }
  });
}

}  // namespace cosine_kernels
