#pragma once
// Chapter 8b's GEMV loops: bf16 and fp32 rows, AVX-512 BF16, AVX2 FMA and portable.
// Built by minivllm/kernels/build.py for the CPU that runs it; chapter 8b shows its regions.
// region: bf16_rows
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // x86's vector instructions; elsewhere only the portable loops compile
#endif

// out[m, n] = x[m, :] . w[n, :] for rows n in [begin, end) and M rows of x: each weight row read once, start to
// end, for all M rows of x, so that a thread reads its weights in the order they lie in memory.
template <int M, typename T>  // AVX2's loop, written with the fp32 product below
void fma_rows(const T* X, const T* W, T* O, int64_t K, int64_t N, int64_t begin, int64_t end);
template <int M, typename T>  // the portable loop, written there too
void portable_rows(const T* X, const T* W, T* O, int64_t K, int64_t N, int64_t begin, int64_t end);

template <int M>
void gemv_rows(const at::BFloat16* X, const at::BFloat16* W, at::BFloat16* O, int64_t K, int64_t N,
               int64_t begin, int64_t end) {
#ifdef __AVX512BF16__
  for (int64_t n = begin; n < end; ++n) {
    const at::BFloat16* w = W + n * K;
    __m512 acc[M][2];  // two sums per row of x: two independent chains of vdpbf16ps in flight
    for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {  // 32 bf16, one 64-byte line of the row, into each sum in turn
      const int s = (k / 32) % 2;  // (K is a multiple of 32)
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
      for (int m = 0; m < M; ++m)
        acc[m][s] = _mm512_dpbf16_ps(acc[m][s], wv, (__m512bh)_mm512_loadu_si512(X + m * K + k));
    }
    for (int m = 0; m < M; ++m)  // the 32 partial sums of each output, added, rounded to bf16 once
      O[m * N + n] = at::BFloat16(_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  fma_rows<M>(X, W, O, K, N, begin, end);
#else
  portable_rows<M>(X, W, O, K, N, begin, end);
#endif
}
// endregion

// region: loads
// Eight numbers of a row as eight floats, for the FMA loop: fp32 as they are; bf16, the top half of a float32,
// widened by a shift.
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}
#endif
// endregion

// region: fma_rows
// The same product with AVX2's fused multiply-add (vfmadd231ps): eight floats of a weight row times eight of an
// activation row, added into eight fp32 sums, one instruction; fp32 or bf16 rows, which load8 widens to floats.
#if defined(__AVX2__) && defined(__FMA__)
template <int M, typename T>
void fma_rows(const T* X, const T* W, T* O, int64_t K, int64_t N, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {  // one weight row at a time, start to end, serving all M rows of x
    const T* w = W + n * K;
    __m256 acc[M][4];  // four sums per row of x: four independent chains of FMAs in flight
    for (int m = 0; m < M; ++m) for (int s = 0; s < 4; ++s) acc[m][s] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)  // eight weights into each sum in turn
      for (int s = 0; s < 4; ++s) {
        const __m256 wv = load8(w + k + 8 * s);
        for (int m = 0; m < M; ++m) acc[m][s] = _mm256_fmadd_ps(wv, load8(X + m * K + k + 8 * s), acc[m][s]);
      }
    for (; k < K; k += 8) {  // the last 8 to 24 weights of the row (K is a multiple of 8), into the first sum
      const __m256 wv = load8(w + k);
      for (int m = 0; m < M; ++m) acc[m][0] = _mm256_fmadd_ps(wv, load8(X + m * K + k), acc[m][0]);
    }
    for (int m = 0; m < M; ++m) {  // the 32 partial sums of each output, added (and rounded once, for bf16)
      const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]));
      const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
      const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
      O[m * N + n] = T(_mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair))));
    }
  }
}
inline bool has_fma() { return true; }  // whether this build has the FMA loop (build.py chose its instructions)
#else
inline bool has_fma() { return false; }
#endif
// endregion

// region: portable_rows
// The portable loop, for bf16 and fp32 alike: for each weight row, one pass per row of x (widen, multiply, sum in
// fp32, vectorised by the compiler), each sum rounded to T once.
template <int M, typename T>
void portable_rows(const T* X, const T* W, T* O, int64_t K, int64_t N, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n)
    for (int m = 0; m < M; ++m) {
      float dot = 0.f;
      #pragma omp simd reduction(+:dot)
      for (int64_t k = 0; k < K; ++k) dot += static_cast<float>(X[m * K + k]) * static_cast<float>(W[n * K + k]);
      O[m * N + n] = T(dot);
    }
}
// fp32's gemv_rows: the FMA loop where this build has it, else the portable loop.
template <int M>
void gemv_rows(const float* X, const float* W, float* O, int64_t K, int64_t N, int64_t begin, int64_t end) {
#if defined(__AVX2__) && defined(__FMA__)
  fma_rows<M>(X, W, O, K, N, begin, end);
#else
  portable_rows<M>(X, W, O, K, N, begin, end);
#endif
}
// endregion
