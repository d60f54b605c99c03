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
};
#else
#error "the project's CPU kernels need AVX-512 or AVX2 with FMA"
#endif

// f(std::integral_constant<int, rows>) for 1 <= rows <= M: a kernel templated on its row count.
template <int M, class F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (M > 1) {
    if (rows < M) return with_rows<M - 1>(rows, f);
  }
  f(std::integral_constant<int, M>{});
}

}  // namespace cosine_kernels
