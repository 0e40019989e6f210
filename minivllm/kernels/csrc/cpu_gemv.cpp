// Chapter 8b's GEMV: nn.Linear's product for 1 to 4 rows, bf16 or fp32.
// Built by minivllm/kernels/build.py for the CPU that runs it; chapter 8b shows its regions.
#include "gemv_loops.h"

// region: call
// x [M, K] times w [N, K] transposed: the product of nn.Linear, for 1 to 4 rows, all of type T. The loops are
// the gemv_rows overload for T; `line` is how many weights of a row they take at once.
template <typename T>
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, const char* name, const char* type_name, int64_t line) {
  const auto dtype = c10::CppTypeToScalarType<T>::value;
  TORCH_CHECK(x.scalar_type() == dtype && w.scalar_type() == dtype, name, ": x and w must be ", type_name);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": x must be [M, K] and w [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 4, name, ": x must have 1 to 4 rows, not ", x.size(0));
  TORCH_CHECK(w.size(1) % line == 0, name, ": K must be a multiple of ", line, ", not ", w.size(1));
  auto xc = x.contiguous(), wc = w.contiguous();  // no copy for a layer's own weights
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto out = torch::empty({M, N}, x.options());
  const T* X = xc.data_ptr<T>();
  const T* W = wc.data_ptr<T>();
  T* O = out.data_ptr<T>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {  // each thread: a range of weight rows
    switch (M) {
      case 1: gemv_rows<1>(X, W, O, K, N, begin, end); break;
      case 2: gemv_rows<2>(X, W, O, K, N, begin, end); break;
      case 3: gemv_rows<3>(X, W, O, K, N, begin, end); break;
      default: gemv_rows<4>(X, W, O, K, N, begin, end);
    }
  });
  return out;
}

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w) {
  return gemv<at::BFloat16>(x, w, "gemv_bf16", "bfloat16", 32);
}
torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w) { return gemv<float>(x, w, "gemv_f32", "float32", 8); }

bool has_dpbf16() {  // whether this build has the AVX-512 BF16 loop (build.py chose its instructions)
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}
// endregion

// The Python module: TORCH_EXTENSION_NAME is set by minivllm/kernels/build.py, one name per build.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv_bf16", torch::wrap_pybind_function(gemv_bf16), "gemv_bf16");
  m.def("gemv_f32", torch::wrap_pybind_function(gemv_f32), "gemv_f32");
  m.def("has_dpbf16", torch::wrap_pybind_function(has_dpbf16), "has_dpbf16");
  m.def("has_fma", torch::wrap_pybind_function(has_fma), "has_fma");
}
