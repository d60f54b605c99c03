// One vector register of floats for the project's CPU kernels, and the instruction set it is
// compiled for (-march=native picks AVX-512 where the CPU has it, else AVX2 with FMA), plus the
// dispatch from a run-time row count to a kernel compiled for exactly that many rows.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>

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

}  // namespace cosine_kernels
