// Chapter 8b's int8 weights' product: int16-rounded activations times int8 rows, exact integer sums.
// Built by minivllm/kernels/build.py for the CPU that runs it; chapter 8b shows its regions.
// region: dots
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // x86's vector instructions; elsewhere only the portable loops compile
#endif
#include <cmath>

constexpr int64_t CHUNK = 512;  // 512 x 127 x 32767 < 2^31: no chunk's int32 sum overflows, whatever the signs

// total[m] += x[m, first:last] . w[first:last] in integers, for M rows of x (int16) and one weight row (int8).
// Integer sums are exact in any order: the VNNI loop and the portable loop give the same totals.
template <int M>
void chunk_dots(const int16_t* X, const int8_t* w, int64_t K, int64_t first, int64_t last, int64_t* total) {
#ifdef __AVX512VNNI__
  __m512i acc[M][2];  // two int32 sums per row of x: two chains of vpdpwssd in flight
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
  int64_t k = first;
  for (; k + 64 <= last; k += 64)  // 32 weights into each sum in turn, widened to int16: 16 pairs per int32 lane
    for (int s = 0; s < 2; ++s) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 32 * s)));
      for (int m = 0; m < M; ++m)
        acc[m][s] = _mm512_dpwssd_epi32(acc[m][s], wv, _mm512_loadu_si512(X + m * K + k + 32 * s));
    }
  for (; k < last; k += 32) {  // the chunk's last 1 to 63 weights, loaded under a mask (zeros past the end)
    const __mmask32 live = last - k >= 32 ? ~0u : (1u << (last - k)) - 1;
    const __m512i wv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(live, w + k));
    for (int m = 0; m < M; ++m)
      acc[m][0] = _mm512_dpwssd_epi32(acc[m][0], wv, _mm512_maskz_loadu_epi16(live, X + m * K + k));
  }
  for (int m = 0; m < M; ++m) total[m] += _mm512_reduce_add_epi32(_mm512_add_epi32(acc[m][0], acc[m][1]));
#else
  for (int m = 0; m < M; ++m) {
    int32_t dot = 0;
    for (int64_t k = first; k < last; ++k) dot += int32_t(w[k]) * int32_t(X[m * K + k]);
    total[m] += dot;
  }
#endif
}

bool has_vnni() {  // whether this build has the VNNI loop (build.py chose its instructions)
#ifdef __AVX512VNNI__
  return true;
#else
  return false;
#endif
}
// endregion

// region: rows
// out[m, n] = (x[m, :] . q[n, :]) * A[m] * S[n] for the weight rows n in [begin, end) and M rows of x (int16):
// each weight row read once, start to end, for all M rows, in chunks whose int32 sums are added in int64
template <int M>
void int8_rows(const int16_t* X, const int8_t* W, const float* A, const float* S, float* O, int64_t K, int64_t N,
               int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    int64_t total[M] = {};
    for (int64_t first = 0; first < K; first += CHUNK)
      chunk_dots<M>(X, W + n * K, K, first, std::min(K, first + CHUNK), total);
    for (int m = 0; m < M; ++m) O[m * N + n] = static_cast<float>(total[m]) * A[m] * S[n];
  }
}

// Each row of x as int16 steps of its own: A[m] = max |x[m, :]| / 32767, X[m, k] = round(x[m, k] / A[m]). A row
// holding a NaN or an infinity gets A[m] = NaN (and X = 0), so that its outputs are NaN.
void round_rows(const float* x, int16_t* X, float* A, int64_t M, int64_t K) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      float largest = 0.f, poison = 0.f;  // poison: NaN if the row holds a NaN or an infinity (their product by 0)
      #pragma omp simd reduction(max:largest) reduction(+:poison)
      for (int64_t k = 0; k < K; ++k) largest = std::max(largest, std::fabs(row[k])), poison += row[k] * 0.f;
      const bool finite = poison == 0.f;
      A[m] = !finite ? NAN : largest > 0.f ? largest / 32767.f : 1.f;
      #pragma omp simd
      for (int64_t k = 0; k < K; ++k)
        X[m * K + k] = finite ? static_cast<int16_t>(std::nearbyint(row[k] / A[m])) : 0;
    }
  });
}
// endregion

// region: call
// out [M, N] = (x [M, K] . q [N, K] transposed) * scale [N], for any M: x rounded to int16 rows first, then per
// block of 16 weight rows, the rows of x four at a time (the block stays in cache between them)
torch::Tensor gemv_int8(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "gemv_int8: x must be float32, q int8 and scale float32");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1) && scale.dim() == 1 &&
              scale.size(0) == q.size(0), "gemv_int8: x must be [M, K], q [N, K] and scale [N]");
  auto xc = x.contiguous(), qc = q.contiguous(), sc = scale.contiguous();
  const int64_t M = x.size(0), N = q.size(0), K = q.size(1);
  auto rounded = torch::empty({M, K}, x.options().dtype(at::kShort)), steps = torch::empty({M}, x.options());
  round_rows(xc.data_ptr<float>(), rounded.data_ptr<int16_t>(), steps.data_ptr<float>(), M, K);
  auto out = torch::empty({M, N}, x.options());
  const int16_t* X = rounded.data_ptr<int16_t>();
  const int8_t* W = qc.data_ptr<int8_t>();
  const float *A = steps.data_ptr<float>(), *S = sc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, (N + 15) / 16, 4, [&](int64_t begin, int64_t end) {
    for (int64_t first = 16 * begin; first < std::min(N, 16 * end); first += 16)
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t last = std::min(N, first + 16);
        const int16_t* Xm = X + m * K;
        switch (std::min<int64_t>(4, M - m)) {
          case 1: int8_rows<1>(Xm, W, A + m, S, O + m * N, K, N, first, last); break;
          case 2: int8_rows<2>(Xm, W, A + m, S, O + m * N, K, N, first, last); break;
          case 3: int8_rows<3>(Xm, W, A + m, S, O + m * N, K, N, first, last); break;
          default: int8_rows<4>(Xm, W, A + m, S, O + m * N, K, N, first, last);
        }
      }
  });
  return out;
}
// endregion

// The Python module: TORCH_EXTENSION_NAME is set by minivllm/kernels/build.py, one name per build.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_int8", torch::wrap_pybind_function(gemv_int8), "gemv_int8");
  m.def("has_vnni", torch::wrap_pybind_function(has_vnni), "has_vnni");
}
