// Chapter 8b's RMSNorm and rotary embedding, one call each.
// Built by minivllm/kernels/build.py for the CPU that runs it; chapter 8b shows its regions.
// region: rows
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

template <typename T>  // y = w * round(x / sqrt(mean(x^2) + eps)): chapter 1's RMSNorm, row by row, in fp32
void rms_rows(const T* X, const T* Wt, T* Y, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x = X + r * dim;
      float squares = 0.f;
      #pragma omp simd reduction(+:squares)
      for (int64_t d = 0; d < dim; ++d) squares += static_cast<float>(x[d]) * static_cast<float>(x[d]);
      const float scale = 1.f / std::sqrt(squares / dim + eps);
      for (int64_t d = 0; d < dim; ++d)
        Y[r * dim + d] = T(static_cast<float>(Wt[d]) * static_cast<float>(T(static_cast<float>(x[d]) * scale)));
    }
  });
}

template <typename T, typename U>  // x[t, h] rotated in place by position P[t]'s angles: "rotate half" layout
void rotate_rows(T* X, const int64_t* P, const U* C, const U* S, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      T* x = X + (t * heads + h) * dim;
      const U* c = C + P[t] * half;
      const U* s = S + P[t] * half;
      for (int64_t i = 0; i < half; ++i) {  // in fp32, as chapter 1's x.float() * cos (bf16 tables widened)
        const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + half]);
        const float cc = static_cast<float>(c[i]), ss = static_cast<float>(s[i]);
        x[i] = T(a * cc - b * ss);
        x[i + half] = T(b * cc + a * ss);
      }
    }
}
// endregion

// region: calls
template <typename F>  // f(pointer) with the tensor's data as float or bf16: the two types of the kernels
void with_type(torch::Tensor x, F f) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  if (x.scalar_type() == at::kFloat) f(x.data_ptr<float>()); else f(x.data_ptr<at::BFloat16>());
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(-1) &&
              weight.is_contiguous(), "rms_norm: weight must be x's dtype, one row of x's width");
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t dim = x.size(-1);
  with_type(xc, [&](auto* X) {
    using T = std::remove_pointer_t<decltype(X)>;
    rms_rows(X, weight.data_ptr<T>(), y.data_ptr<T>(), xc.numel() / dim, dim, static_cast<float>(eps));
  });
  return y;
}

void rotary_(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && cos.is_contiguous() &&
              sin.is_contiguous() && sin.scalar_type() == cos.scalar_type() && sin.sizes() == cos.sizes(),
              "rotary_: positions must be int64, the tables of one dtype and shape, all contiguous");
  const int64_t* P = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)  // never read outside the tables, whatever the caller passes
    TORCH_CHECK(P[t] >= 0 && P[t] < cos.size(0), "rotary_: position ", P[t], " is outside the tables");
  for (auto x : {q, k})
    TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.size(0) == positions.numel() && x.size(2) == 2 * cos.size(1),
                "rotary_: q and k must be contiguous [tokens, heads, head_dim], one position per token");
  with_type(cos, [&](auto* C) {
    const auto* S = sin.data_ptr<std::remove_pointer_t<decltype(C)>>();
    for (auto x : {q, k}) with_type(x, [&](auto* X) { rotate_rows(X, P, C, S, x.size(0), x.size(1), x.size(2)); });
  });
}
// endregion

// The Python module: TORCH_EXTENSION_NAME is set by minivllm/kernels/build.py, one name per build.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "rms_norm");
  m.def("rotary_", torch::wrap_pybind_function(rotary_), "rotary_");
}
