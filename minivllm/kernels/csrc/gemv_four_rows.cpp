// A book-only variant of the fp32 GEMV: four weight rows in step (chapter 8b measures it against one at a time).
// Built by minivllm/kernels/build.py for the CPU that runs it; chapter 8b shows its regions.
#include "gemv_loops.h"

// region: four_rows
// The order the FMA loop replaced: four weight rows in step, one sum each, eight weights of each row per turn
// (or, without AVX2, the portable loop's sums, the four rows still in step)
torch::Tensor gemv_four_rows(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) == 1 &&
              w.dim() == 2 && x.size(1) == w.size(1) && w.size(0) % 4 == 0 && w.size(1) % 8 == 0 &&
              x.is_contiguous() && w.is_contiguous(), "gemv_four_rows: one fp32 row times [4n, 8k] fp32 weights");
  const int64_t N = w.size(0), K = w.size(1);
  auto out = torch::empty({1, N}, x.options());
  const float *X = x.data_ptr<float>(), *W = w.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, N / 4, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = 4 * begin; n < 4 * end; n += 4) {
#if defined(__AVX2__) && defined(__FMA__)
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t k = 0; k < K; k += 8)
        for (int r = 0; r < 4; ++r) acc[r] = _mm256_fmadd_ps(load8(W + (n + r) * K + k), load8(X + k), acc[r]);
      for (int r = 0; r < 4; ++r) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[r]);
        O[n + r] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      }
#else  // the portable loop's way: the compiler vectorises the four sums, the rows still in step
      const float *w0 = W + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      #pragma omp simd reduction(+:s0, s1, s2, s3)
      for (int64_t k = 0; k < K; ++k) s0 += w0[k] * X[k], s1 += w1[k] * X[k], s2 += w2[k] * X[k], s3 += w3[k] * X[k];
      O[n] = s0, O[n + 1] = s1, O[n + 2] = s2, O[n + 3] = s3;
#endif
    }
  });
  return out;
}
// endregion

// The Python module: TORCH_EXTENSION_NAME is set by minivllm/kernels/build.py, one name per build.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_four_rows", torch::wrap_pybind_function(gemv_four_rows), "gemv_four_rows");
}
