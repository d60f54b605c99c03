// y = x @ W.T for a few float32 rows x [M, K] and a weight W [N, K], reading W once.
//
// A verify pass on a CPU multiplies every weight matrix by a handful of rows. Up to a dozen or so
// rows the product is bound by reading the weight, not by arithmetic, so it should cost what one
// row costs. Blocks of R weight rows are streamed from memory once (prefetched ahead); for each
// block, the input rows are taken G at a time with R x G accumulators held in AVX-512 registers,
// and a block's later groups find its weight rows still in L1. K must be a multiple of 16.
//
// Two instruction sets, one chosen when the extension is compiled for its machine (-march=native):
// AVX-512 (16 floats a register, 32 registers) and AVX2 with FMA (8 floats, 16 registers). The
// AVX2 kernels hold fewer accumulators (4 input rows a streamed block; 6 rows of one panel a panel
// micro-tile, 4 a block-code tile, whose dequantized weights the other rows read from L1 from nine
// rows on) and keep the same packing and summation order, so a row's result stays independent of the
// rows beside it on either.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <algorithm>

namespace {

using cosine_kernels::claim_for;
using cosine_kernels::ISA;
using cosine_kernels::Vec;
using cosine_kernels::with_rows;

constexpr int G = Vec::W == 16 ? 8 : 4;  // input rows whose accumulators live in registers at once (24 of 32; 12 of 16)
constexpr int R = 3;                 // weight rows a block streams together
constexpr int64_t PREFETCH = 256;    // floats ahead of the loads (1 KiB)

template <int M, int RB>
inline void tile(const float* x, int64_t K, const float* w, float* y, int64_t N, int64_t n) {
  typename Vec::T acc[RB][M];
  for (int r = 0; r < RB; r++)
    for (int m = 0; m < M; m++) acc[r][m] = Vec::zero();
  for (int64_t k = 0; k < K; k += Vec::W) {
    typename Vec::T wv[RB];
    for (int r = 0; r < RB; r++) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + r) * K + k + PREFETCH), _MM_HINT_T0);
      wv[r] = Vec::load(w + (n + r) * K + k);
    }
    for (int m = 0; m < M; m++) {
      const typename Vec::T xv = Vec::load(x + m * K + k);
      for (int r = 0; r < RB; r++) acc[r][m] = Vec::fma(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < RB; r++)
    for (int m = 0; m < M; m++) y[m * N + n + r] = Vec::sum(acc[r][m]);
}

template <int RB>
inline void block(const float* x, int64_t M, int64_t K, const float* w, float* y, int64_t N, int64_t n) {
  for (int64_t m0 = 0; m0 < M; m0 += G)
    with_rows<G>(std::min<int64_t>(G, M - m0), [&](auto rows) { tile<decltype(rows)::value, RB>(x + m0 * K, K, w, y + m0 * N, N, n); });
}

#if defined(__AVX512F__)

// The panel kernel: y = x @ W.T with W packed once into column panels P [N/16, K, 16] (P[p, k, j] =
// W[16p + j, k]). Written for passes past a few rows, where the product is bound by arithmetic;
// on the machine measured it was also the fastest down to one row.
// Each output vector of 16 columns is an accumulator; an input element is broadcast and multiplied
// into PV panels at once, so there are no horizontal sums. A thread takes PV panels at a time and
// walks their inner dimension in chunks of PK steps; a chunk (PK x PV x 64 bytes) is read from
// memory once and stays in L1 while every group of PG input rows adds its products to y. Each
// output is summed in the order k = 0, 1, ..., K-1 whatever the number of rows.
constexpr int PV = 3;                // panels (of 16 columns) a micro-tile spans
constexpr int PG = 8;                // input rows a micro-tile spans
constexpr int64_t PK = 128;          // inner steps a chunk spans (24 KiB of panels at PV = 3)
constexpr int64_t PANEL_AHEAD = 16;  // k steps (one 64-byte line a panel each) prefetched ahead

// p: panel 0's step k0; panels are ``stride`` floats apart (K * 16 in the packed weight, less in a
// chunk dequantized from 8-bit codes: see block_panel_linear)
template <int M, int V>
inline void panel_tile(const float* x, int64_t K, const float* p, int64_t stride, int64_t k0, int64_t k1, float* y, int64_t N) {
  __m512 acc[M][V];
  for (int m = 0; m < M; m++)
    for (int v = 0; v < V; v++) acc[m][v] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * N + v * 16);
  for (int64_t k = k0; k < k1; k++) {
    __m512 wv[V];
    for (int v = 0; v < V; v++) {
      const float* at = p + v * stride + (k - k0) * 16;
      _mm_prefetch(reinterpret_cast<const char*>(at + PANEL_AHEAD * 16), _MM_HINT_T0);
      wv[v] = _mm512_loadu_ps(at);
    }
    for (int m = 0; m < M; m++) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      for (int v = 0; v < V; v++) acc[m][v] = _mm512_fmadd_ps(wv[v], xv, acc[m][v]);
    }
  }
  for (int m = 0; m < M; m++)
    for (int v = 0; v < V; v++) _mm512_storeu_ps(y + m * N + v * 16, acc[m][v]);
}

// every row's products with ``panels`` panels (p: panel 0's step k0, ``stride`` floats apart) over steps [k0, k1)
inline void panel_chunk(const float* x, int64_t M, int64_t K, const float* p, int64_t stride, int64_t panels, int64_t k0, int64_t k1,
                        float* y, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += PG) {
    const int64_t rows = std::min<int64_t>(PG, M - m0);
    with_rows<PV>(panels, [&](auto v) {
      with_rows<PG>(rows, [&](auto m) { panel_tile<decltype(m)::value, decltype(v)::value>(x + m0 * K, K, p, stride, k0, k1, y + m0 * N, N); });
    });
  }
}

#else  // AVX2 with FMA

// The panel kernel as above, a panel of 16 columns being two registers: a micro-tile is one panel
// and up to PG input rows (12 accumulators), a chunk PK x 64 bytes.
constexpr int PV = 1;                // panels a thread's group spans
constexpr int PG = 6;                // input rows a micro-tile spans
constexpr int64_t PK = 128;          // inner steps a chunk spans (8 KiB of one panel)
constexpr int64_t PANEL_AHEAD = 16;  // k steps prefetched ahead

// One step of a panel (its 16 weights: two registers) times each of M rows' value at step k, added
// to the rows' accumulators: the one multiply-add order of the AVX2 panel and block-code tiles, so
// their products are the same bits.
template <int M>
inline void add_step(__m256* lo, __m256* hi, __m256 wlo, __m256 whi, const float* x, int64_t K, int64_t k) {
  for (int m = 0; m < M; m++) {
    const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
    lo[m] = _mm256_fmadd_ps(wlo, xv, lo[m]);
    hi[m] = _mm256_fmadd_ps(whi, xv, hi[m]);
  }
}

template <int M>
inline void store_rows(const __m256* lo, const __m256* hi, float* y, int64_t N) {
  for (int m = 0; m < M; m++) {
    _mm256_storeu_ps(y + m * N, lo[m]);
    _mm256_storeu_ps(y + m * N + 8, hi[m]);
  }
}

template <int M>
inline void panel_tile(const float* x, int64_t K, const float* p, int64_t stride, int64_t k0, int64_t k1, float* y, int64_t N) {
  (void)stride;  // one panel (PV)
  __m256 lo[M], hi[M];
  for (int m = 0; m < M; m++) {
    lo[m] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * N);
    hi[m] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(y + m * N + 8);
  }
  for (int64_t k = k0; k < k1; k++) {
    const float* at = p + (k - k0) * 16;
    _mm_prefetch(reinterpret_cast<const char*>(at + PANEL_AHEAD * 16), _MM_HINT_T0);
    add_step<M>(lo, hi, _mm256_loadu_ps(at), _mm256_loadu_ps(at + 8), x, K, k);
  }
  store_rows<M>(lo, hi, y, N);
}

inline void panel_chunk(const float* x, int64_t M, int64_t K, const float* p, int64_t stride, int64_t panels, int64_t k0, int64_t k1,
                        float* y, int64_t N) {
  (void)panels;  // one (PV)
  for (int64_t m0 = 0; m0 < M; m0 += PG) {
    with_rows<PG>(std::min<int64_t>(PG, M - m0), [&](auto m) { panel_tile<decltype(m)::value>(x + m0 * K, K, p, stride, k0, k1, y + m0 * N, N); });
  }
}

#endif

// A thread's panels: every chunk of PK steps in turn (each output summed in the order k = 0 .. K-1)
inline void panel_group(const float* x, int64_t M, int64_t K, const float* p, int64_t panels, float* y, int64_t N) {
  for (int64_t k0 = 0; k0 < K; k0 += PK) panel_chunk(x, M, K, p + k0 * 16, K * 16, panels, k0, std::min<int64_t>(K, k0 + PK), y, N);
}

// The block-code panel kernel: the panel kernel on a weight held as 8-bit codes. Each output's
// weights come in blocks of BLOCK inner steps with a scale d and an offset m (float16), w = d * q + m
// (the form of GGUF's Q8_0 and Q4_1 weights, and of any weight found to be exactly that: see
// common/runtime/block_weights.py). Up to FUSED_ROWS rows a thread dequantizes its panels' codes in
// registers as its micro-tiles step through them (block_tile); past that it dequantizes a chunk of
// its panels (PV x PK x 16 floats, the panel kernel's chunk) into a buffer that stays in L1 and runs
// the panel kernel's micro-tiles on it. Either way the products are the panel kernel's bit for bit
// (the same fused multiply-adds in the same order on the same weights: fma(q, d, m) rounds once, like
// d * q + m, since q * d is exact in float32) while a pass reads a quarter of the bytes.
constexpr int64_t BLOCK = 32;
// up to this many rows the codes are dequantized in registers (else into a chunk buffer); on AVX2,
// from SHARED_FROM rows, once for all rows, shared through L1 (block_rows): quicker than the chunk
// buffer up to 48 rows on an AVX2-only EPYC (0.81-0.94 of it at 17-40 rows, level at 48)
constexpr int64_t FUSED_ROWS = Vec::W == 16 ? 16 : 48;
static_assert(PK % BLOCK == 0, "a chunk spans whole blocks");

// 16 weights of one step of one panel: d * q + m, lane by lane
inline void dequant16(const int8_t* q, const uint16_t* d, const uint16_t* m, float* out) {
#if defined(__AVX512F__)
  const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d)));
  const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m)));
  _mm512_storeu_ps(out, _mm512_fmadd_ps(qf, dv, mv));
#else
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  for (int h = 0; h < 2; h++) {
    const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(c, 8) : c));
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 8 * h)));
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + 8 * h)));
    _mm256_storeu_ps(out + 8 * h, _mm256_fmadd_ps(qf, dv, mv));
  }
#endif
}

#if defined(__AVX512F__)
// Up to PG rows times V panels over the whole inner dimension, the weights dequantized in registers
// as the tile steps through them.
template <int M, int V>
inline void block_tile(const float* x, int64_t K, const int8_t* codes, const uint16_t* scales, float* y, int64_t N) {
  const int64_t blocks = K / BLOCK;
  __m512 acc[M][V];
  for (int m = 0; m < M; m++)
    for (int v = 0; v < V; v++) acc[m][v] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < K; b0 += BLOCK) {
    __m512 dv[V], mv[V];
    for (int v = 0; v < V; v++) {
      const uint16_t* sc = scales + (v * blocks + b0 / BLOCK) * 2 * 16;
      dv[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
      mv[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16)));
    }
    for (int64_t k = b0; k < b0 + BLOCK; k++) {
      __m512 wv[V];
      for (int v = 0; v < V; v++) {
        const int8_t* at = codes + (v * K + k) * 16;
        _mm_prefetch(reinterpret_cast<const char*>(at + 4 * 64), _MM_HINT_T0);
        const __m512 qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
        wv[v] = _mm512_fmadd_ps(qf, dv[v], mv[v]);
      }
      for (int m = 0; m < M; m++) {
        const __m512 xv = _mm512_set1_ps(x[m * K + k]);
        for (int v = 0; v < V; v++) acc[m][v] = _mm512_fmadd_ps(wv[v], xv, acc[m][v]);
      }
    }
  }
  for (int m = 0; m < M; m++)
    for (int v = 0; v < V; v++) _mm512_storeu_ps(y + m * N + v * 16, acc[m][v]);
}
#else  // AVX2 with FMA

// Up to BG rows of one panel over the whole inner dimension, the weights dequantized in registers as
// the tile steps through them: the panel's scales and offsets (4 registers), its 16 weights of a step
// (2), a broadcast row value (1) and BG x 2 accumulators fit AVX2's 16 registers. The same fused
// multiply-adds in the same order as dequant16 then panel_tile (add_step), so the same bits.
constexpr int BG = 4;

// A block's scales (low and high half of the panel), then its offsets, as floats
inline void block_scales(const uint16_t* sc, __m256 (&dm)[4]) {
  for (int i = 0; i < 4; i++) dm[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 8 * i)));
}

// The 16 weights of step k of a panel, d * q + m (the codes prefetched ahead)
inline void step_weights(const int8_t* codes, int64_t k, const __m256 (&dm)[4], __m256& wlo, __m256& whi) {
  const int8_t* at = codes + k * 16;
  _mm_prefetch(reinterpret_cast<const char*>(at + 4 * 64), _MM_HINT_T0);
  const __m256 qlo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at))));
  const __m256 qhi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 8))));
  wlo = _mm256_fmadd_ps(qlo, dm[0], dm[2]);
  whi = _mm256_fmadd_ps(qhi, dm[1], dm[3]);
}

template <int M>
inline void block_tile(const float* x, int64_t K, const int8_t* codes, const uint16_t* scales, float* y, int64_t N) {
  __m256 lo[M], hi[M];
  for (int m = 0; m < M; m++) lo[m] = hi[m] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < K; b0 += BLOCK) {
    __m256 dm[4];
    block_scales(scales + (b0 / BLOCK) * 2 * 16, dm);
    for (int64_t k = b0; k < b0 + BLOCK; k++) {
      __m256 wlo, whi;
      step_weights(codes, k, dm, wlo, whi);
      add_step<M>(lo, hi, wlo, whi, x, K, k);
    }
  }
  store_rows<M>(lo, hi, y, N);
}

// Five or six rows of one panel in one tile: block_tile's multiply-adds on the same weights in the
// same order (so the same bits), with ten or twelve accumulators. block_tile's scales and offsets
// take four registers, so past four rows a panel took a tile of four and then one of one or two,
// which dequantizes every step again and whose two or four chains of multiply-adds wait on each
// other's latency: on an AVX2-only EPYC the fifth row cost 40% of a four-row product. Here a step's
// weights are made with the block's scales and offsets read from L1 by the instructions, which
// leaves the registers to the accumulators. Written in assembly for the steps of a block: in
// intrinsics the compiler kept the accumulators in memory, storing them at every step (1.4-1.9x
// slower). All of SmolLM2-135M's projections, both builds in one process, 30 paired rounds, new /
// old: 0.81-0.82 at five rows, 0.80-0.83 at six, level at one, four and eight.
constexpr int64_t WIDE_FROM = 5, WIDE_TO = 6;

// One block's steps (BLOCK of them). In registers: ymm0 a row's broadcast value (first the step's
// codes as floats), ymm1 and ymm2 the step's 16 weights w = q * d + m (d low, d high, m low, m high
// at dm), r8 the codes, r9 row 0 (rows 1, 2 at r11 and 2 * r11 bytes on), r10 row 3 (rows 4, 5
// likewise), rax the steps left; then acc += w * x, row by row.
#define COSINE_WIDE_START                                          \
  "mov (%[a]), %%r8\n\t"                                           \
  "mov 8(%[a]), %%r9\n\t"                                          \
  "mov 16(%[a]), %%r10\n\t"                                        \
  "mov 24(%[a]), %%r11\n\t"                                        \
  "mov $32, %%eax\n\t"                                             \
  "1:\n\t"                                                         \
  "vpmovsxbd (%%r8), %%ymm0\n\t"                                   \
  "prefetcht0 256(%%r8)\n\t"                                       \
  "vcvtdq2ps %%ymm0, %%ymm0\n\t"                                   \
  "vmovaps 64(%[dm]), %%ymm1\n\t"                                  \
  "vfmadd231ps (%[dm]), %%ymm0, %%ymm1\n\t"                        \
  "vpmovsxbd 8(%%r8), %%ymm0\n\t"                                  \
  "vcvtdq2ps %%ymm0, %%ymm0\n\t"                                   \
  "vmovaps 96(%[dm]), %%ymm2\n\t"                                  \
  "vfmadd231ps 32(%[dm]), %%ymm0, %%ymm2\n\t"
#define COSINE_WIDE_ROW(addr, lo, hi)                              \
  "vbroadcastss " addr ", %%ymm0\n\t"                              \
  "vfmadd231ps %%ymm0, %%ymm1, %[" lo "]\n\t"                      \
  "vfmadd231ps %%ymm0, %%ymm2, %[" hi "]\n\t"
#define COSINE_WIDE_NEXT                                           \
  "add $16, %%r8\n\t"                                              \
  "add $4, %%r9\n\t"                                               \
  "add $4, %%r10\n\t"                                              \
  "dec %%eax\n\t"                                                  \
  "jnz 1b\n\t"
static_assert(BLOCK == 32, "the wide tile's assembly steps through 32 steps a block");

// Rows 0-4 (every wide tile's), and their accumulators as operands
#define COSINE_WIDE_FIVE_ROWS                                                                                  \
  COSINE_WIDE_ROW("(%%r9)", "l0", "h0") COSINE_WIDE_ROW("(%%r9,%%r11)", "l1", "h1")                             \
  COSINE_WIDE_ROW("(%%r9,%%r11,2)", "l2", "h2") COSINE_WIDE_ROW("(%%r10)", "l3", "h3")                           \
  COSINE_WIDE_ROW("(%%r10,%%r11)", "l4", "h4")
#define COSINE_WIDE_FIVE_ACCS                                                                                  \
  [l0] "+x"(l0), [l1] "+x"(l1), [l2] "+x"(l2), [l3] "+x"(l3), [l4] "+x"(l4),                                   \
  [h0] "+x"(h0), [h1] "+x"(h1), [h2] "+x"(h2), [h3] "+x"(h3), [h4] "+x"(h4)
#define COSINE_WIDE_INPUTS_CLOBBERS                                                                            \
  : [dm] "r"(&dm[0][0]), [a] "r"(a) : "xmm0", "xmm1", "xmm2", "r8", "r9", "r10", "r11", "rax", "memory", "cc"

template <int M>
inline void wide_tile(const float* x, int64_t K, const int8_t* codes, const uint16_t* scales, float* y, int64_t N) {
  static_assert(M == 5 || M == 6, "wide_tile: five or six rows");
  __m256 l0 = _mm256_setzero_ps(), l1 = l0, l2 = l0, l3 = l0, l4 = l0, l5 = l0;
  __m256 h0 = l0, h1 = l0, h2 = l0, h3 = l0, h4 = l0, h5 = l0;
  alignas(32) float dm[4][8];
  alignas(32) int64_t a[4];
  a[3] = K * 4;  // bytes between rows
  for (int64_t b0 = 0; b0 < K; b0 += BLOCK) {
    __m256 r[4];
    block_scales(scales + (b0 / BLOCK) * 2 * 16, r);
    for (int i = 0; i < 4; i++) _mm256_store_ps(dm[i], r[i]);
    a[0] = reinterpret_cast<int64_t>(codes + b0 * 16);
    a[1] = reinterpret_cast<int64_t>(x + b0);
    a[2] = reinterpret_cast<int64_t>(x + 3 * K + b0);
    if constexpr (M == 6) {
      asm volatile(COSINE_WIDE_START COSINE_WIDE_FIVE_ROWS COSINE_WIDE_ROW("(%%r10,%%r11,2)", "l5", "h5") COSINE_WIDE_NEXT
                   : COSINE_WIDE_FIVE_ACCS, [l5] "+x"(l5), [h5] "+x"(h5) COSINE_WIDE_INPUTS_CLOBBERS);
    } else {
      asm volatile(COSINE_WIDE_START COSINE_WIDE_FIVE_ROWS COSINE_WIDE_NEXT : COSINE_WIDE_FIVE_ACCS COSINE_WIDE_INPUTS_CLOBBERS);
    }
  }
  const __m256 lo[6] = {l0, l1, l2, l3, l4, l5}, hi[6] = {h0, h1, h2, h3, h4, h5};
  store_rows<M>(lo, hi, y, N);
}
#undef COSINE_WIDE_START
#undef COSINE_WIDE_ROW
#undef COSINE_WIDE_NEXT
#undef COSINE_WIDE_FIVE_ROWS
#undef COSINE_WIDE_FIVE_ACCS
#undef COSINE_WIDE_INPUTS_CLOBBERS

// SHARED_FROM to FUSED_ROWS rows of one panel, block by block: the first BG rows dequantize the
// block's steps in registers as block_tile does and leave them in wbuf (BLOCK x 16 floats, in L1),
// and the other rows, BW at a time (12 accumulators, a step's two registers and a broadcast), read
// them from there instead of dequantizing the codes again in a block_tile per four rows.
// Accumulators wait in acc between blocks. Each output is still summed k = 0 .. K-1 with add_step's
// multiply-adds on the same weights, so the same bits as block_tile and the panel kernel. All of
// SmolLM2-135M's projections on an AVX2-only EPYC, two threads, both builds in one process, the
// median of seven paired rounds after / before: 0.85-0.88 at 9, 10 and 13 rows, 0.89 at 16, 0.81-0.84
// at 17-22, 0.87-0.92 at 24-32, level at 12 (0.96-1.05) and 48. Below nine rows it is not used: a
// group of four rows reading wbuf is no quicker than a block_tile of four, which dequantizes
// between its multiply-adds (eight chains of them, a few cycles each, either way), so eight rows
// took 1.13x.
constexpr int BW = 6;
constexpr int64_t SHARED_FROM = 9;

template <int M>
inline void load_acc(const float* acc, __m256* lo, __m256* hi) {
  for (int m = 0; m < M; m++) {
    lo[m] = _mm256_load_ps(acc + m * 16);
    hi[m] = _mm256_load_ps(acc + m * 16 + 8);
  }
}

template <int M>
inline void first_rows(const float* x, int64_t K, const int8_t* codes, int64_t b0, const __m256 (&dm)[4], float* acc, float* wbuf) {
  __m256 lo[M], hi[M];
  load_acc<M>(acc, lo, hi);
  for (int64_t k = b0; k < b0 + BLOCK; k++) {
    __m256 wlo, whi;
    step_weights(codes, k, dm, wlo, whi);
    _mm256_store_ps(wbuf + (k - b0) * 16, wlo);
    _mm256_store_ps(wbuf + (k - b0) * 16 + 8, whi);
    add_step<M>(lo, hi, wlo, whi, x, K, k);
  }
  store_rows<M>(lo, hi, acc, 16);
}

template <int M>
inline void more_rows(const float* x, int64_t K, int64_t b0, const float* wbuf, float* acc) {
  __m256 lo[M], hi[M];
  load_acc<M>(acc, lo, hi);
  for (int64_t k = b0; k < b0 + BLOCK; k++)
    add_step<M>(lo, hi, _mm256_load_ps(wbuf + (k - b0) * 16), _mm256_load_ps(wbuf + (k - b0) * 16 + 8), x, K, k);
  store_rows<M>(lo, hi, acc, 16);
}

inline void block_rows(const float* x, int64_t M, int64_t K, const int8_t* codes, const uint16_t* scales, float* y, int64_t N) {
  alignas(32) float acc[FUSED_ROWS * 16];
  alignas(32) float wbuf[BLOCK * 16];
  std::fill(acc, acc + M * 16, 0.0f);
  for (int64_t b0 = 0; b0 < K; b0 += BLOCK) {
    __m256 dm[4];
    block_scales(scales + (b0 / BLOCK) * 2 * 16, dm);
    first_rows<BG>(x, K, codes, b0, dm, acc, wbuf);
    for (int64_t m0 = BG; m0 < M; m0 += BW)
      with_rows<BW>(std::min<int64_t>(BW, M - m0), [&](auto m) { more_rows<decltype(m)::value>(x + m0 * K, K, b0, wbuf, acc + m0 * 16); });
  }
  for (int64_t m = 0; m < M; m++) {
    _mm256_storeu_ps(y + m * N, _mm256_load_ps(acc + m * 16));
    _mm256_storeu_ps(y + m * N + 8, _mm256_load_ps(acc + m * 16 + 8));
  }
}
#endif

// codes [P, K, 16] (int8), scales [P, K / BLOCK, 2, 16] (d then m, float16): panels' steps [k0, k1) into buf [panels][PK][16]
inline void dequant_chunk(const int8_t* codes, const uint16_t* scales, int64_t K, int64_t panels, int64_t k0, int64_t k1, float* buf) {
  const int64_t blocks = K / BLOCK;
  for (int64_t v = 0; v < panels; v++) {
    for (int64_t k = k0; k < k1; k++) {
      const uint16_t* s = scales + (v * blocks + k / BLOCK) * 2 * 16;
      dequant16(codes + (v * K + k) * 16, s, s + 16, buf + (v * PK + (k - k0)) * 16);
    }
  }
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
  claim_for(blocks, [&](int64_t b) { block<R>(xp, M, K, wp, yp, N, b * R); });
  for (int64_t n = blocks * R; n < N; n++) block<1>(xp, M, K, wp, yp, N, n);
  return y;
}

torch::Tensor pack_panels(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(), "pack_panels: a float32 CPU weight [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 16 == 0, "pack_panels: N must be a multiple of 16");
  return weight.reshape({N / 16, 16, K}).transpose(1, 2).contiguous();
}

torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == 16 && x.size(1) == panels.size(1), "panel_linear: x [M, K], panels [N/16, K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "panel_linear: float32 only");
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu() && panels.is_contiguous(), "panel_linear: contiguous CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = P * 16;
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t groups = (P + PV - 1) / PV;
  claim_for(groups, [&](int64_t g) {
    const int64_t first = g * PV;
    panel_group(xp, M, K, pp + first * K * 16, std::min<int64_t>(PV, P - first), yp + first * 16, N);
  });
  return y;
}

torch::Tensor block_panel_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && codes.size(2) == 16 && x.size(1) == codes.size(1), "block_panel_linear: x [M, K], codes [N/16, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0), N = P * 16;
  TORCH_CHECK(K % BLOCK == 0, "block_panel_linear: K must be a multiple of ", BLOCK);
  TORCH_CHECK(scales.dim() == 4 && scales.size(0) == P && scales.size(1) == K / BLOCK && scales.size(2) == 2 && scales.size(3) == 16,
              "block_panel_linear: scales [N/16, K/", BLOCK, ", 2, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kChar && scales.scalar_type() == at::kHalf,
              "block_panel_linear: float32 rows, int8 codes, float16 scales");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu() && codes.is_contiguous() && scales.is_contiguous(),
              "block_panel_linear: contiguous CPU tensors");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int64_t groups = (P + PV - 1) / PV;
  claim_for(groups, [&](int64_t g) {
    alignas(64) float buf[PV * PK * 16];
    const int64_t first = g * PV, panels = std::min<int64_t>(PV, P - first);
    const int8_t* gc = cp + first * K * 16;                    // the group's codes
    const uint16_t* gs = sp + first * (K / BLOCK) * 2 * 16;    // and its scales and offsets
    if (M <= FUSED_ROWS) {  // the codes dequantized in registers, once per group of PG rows (AVX2: of BG rows, or five or six in a wide tile; from SHARED_FROM, once)
#if defined(__AVX512F__)
      for (int64_t m0 = 0; m0 < M; m0 += PG) {
        with_rows<PV>(panels, [&](auto v) {
          with_rows<PG>(std::min<int64_t>(PG, M - m0), [&](auto m) {
            block_tile<decltype(m)::value, decltype(v)::value>(xp + m0 * K, K, gc, gs,
                                                               yp + m0 * N + first * 16, N);
          });
        });
      }
#else
      if (M >= SHARED_FROM) {
        block_rows(xp, M, K, gc, gs, yp + first * 16, N);
        return;
      }
      if (M == WIDE_FROM || M == WIDE_TO) {
        (M == WIDE_TO ? wide_tile<WIDE_TO> : wide_tile<WIDE_FROM>)(xp, K, gc, gs, yp + first * 16, N);
        return;
      }
      for (int64_t m0 = 0; m0 < M; m0 += BG) {
        with_rows<BG>(std::min<int64_t>(BG, M - m0), [&](auto m) {
          block_tile<decltype(m)::value>(xp + m0 * K, K, gc, gs, yp + m0 * N + first * 16, N);
        });
      }
#endif
      return;
    }
    for (int64_t k0 = 0; k0 < K; k0 += PK) {
      const int64_t k1 = std::min<int64_t>(K, k0 + PK);
      dequant_chunk(gc, gs, K, panels, k0, k1, buf);
      panel_chunk(xp, M, K, buf, PK * 16, panels, k0, k1, yp + first * 16, N);
    }
  });
  return y;
}

// cache_attention.cpp
void cache_attention(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                     const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
                     const std::vector<int64_t>& offsets, const std::vector<int64_t>& lens, const std::vector<bool>& attend,
                     const torch::Tensor& mask, const std::vector<int64_t>& mask_offsets, double scale, torch::Tensor& out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The products and the attention run without the GIL: a service's event loop (its gRPC stream,
  // the next batch's arrival, health checks) goes on while its model thread is in a kernel, instead
  // of waiting for the GIL until the kernel returns.
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("isa", []() { return std::string(ISA); }, "the instruction set the kernels were compiled for: avx512 or avx2");
  m.def("streamed_linear", &streamed_linear, no_gil(), "x @ weight.T, the weight read once (float32)");
  m.def("pack_panels", &pack_panels, "weight [N, K] as column panels [N/16, K, 16] for panel_linear");
  m.def("cache_attention", &cache_attention, no_gil(),
        "write every sequence's new keys/values into its cache, attend the short ones into out (float32)");
  m.def("panel_linear", &panel_linear, no_gil(), "x @ weight.T from the weight's column panels (float32)");
  m.def("block_panel_linear", &block_panel_linear, no_gil(), "x @ weight.T from the weight's 8-bit block codes in column panels (d * q + m)");
}
