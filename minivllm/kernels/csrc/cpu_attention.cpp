// Chapter 8b's decode attention over the paged KV cache, and chapter 5's KV write, for the CPU.
// Built by minivllm/kernels/build.py for the CPU that runs it; chapter 8b shows its regions.
// region: setup
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// A bfloat16 is the top half of a float32: widening one is a shift, done as each key and value is loaded.
inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

// out[s, head] = softmax(q[s, head] . keys(s) * scale) . values(s): one new token per sequence, over its
// seq_lens[s] keys, read in place through its row of block_tables. Caches of float32 or bfloat16; every
// product and sum in float32.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && q.scalar_type() == dtype &&
              v_cache.scalar_type() == dtype, "paged_decode: q and caches must be all float32 or all bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kLong,
              "paged_decode: block_tables must be int32 and seq_lens int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              v_cache.sizes() == k_cache.sizes(), "paged_decode: the caches must be contiguous and of one shape");
  TORCH_CHECK(q.dim() == 3 && block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.dim() == 1 &&
              seq_lens.size(0) == q.size(0), "paged_decode: q [seqs, heads, dim], one table row and length a sequence");
  auto qf = q.to(at::kFloat).contiguous();  // the queries, widened once: a few hundred numbers per sequence
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2), width = tables.size(1);
  TORCH_CHECK(k_cache.size(3) == dim && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "paged_decode: q does not fit the cache");
  const int64_t group = num_heads / num_kv_heads, row = num_kv_heads * dim;  // a token's row: every kv head
  auto out = torch::empty_like(qf);
  const float* Q = qf.data_ptr<float>();
  const int32_t* T = tables.data_ptr<int32_t>();
  const int64_t* L = lens.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  for (int64_t s = 0; s < num_seqs; ++s) {  // never read outside the cache, whatever the caller passes
    TORCH_CHECK(L[s] >= 1 && L[s] <= width * block_size, "paged_decode: seq_lens[", s, "] is out of range");
    for (int64_t b = 0; b < (L[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(T[s * width + b] >= 0 && T[s * width + b] < k_cache.size(0), "paged_decode: bad block id");
  }
// endregion

// region: items
  // Work items: a sequence, or with fewer sequences than threads a run of its blocks, one per thread ("split KV").
  // Each item keeps, per head, its largest score, its sum of exponentials and its unnormalised sum of values.
  const int64_t threads = at::get_num_threads();
  const int64_t parts = num_seqs >= threads ? 1 : (threads + num_seqs - 1) / num_seqs;  // runs per sequence
  std::vector<float> tops(num_seqs * parts * num_heads), totals(num_seqs * parts * num_heads, 0.f);
  std::vector<float> sums(num_seqs * parts * num_heads * dim, 0.f);
  auto attend = [&](const auto* K, const auto* V) {  // one body for both cache types (a generic lambda)
  at::parallel_for(0, num_seqs * parts, 1, [&](int64_t begin, int64_t end) {  // each thread: a range of items
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / parts, part = item % parts, blocks = (L[s] + block_size - 1) / block_size;
      const int64_t first_t = part * blocks / parts * block_size;  // whole blocks: [first_t, end_t)
      const int64_t end_t = std::min(L[s], (part + 1) * blocks / parts * block_size), n = end_t - first_t;
      if (n <= 0) continue;  // more parts than blocks: an empty run (its total stays 0)
      const float* qs = Q + s * num_heads * dim;
      scores.resize(num_heads * n);
// endregion

// region: scores
      for (int64_t t0 = first_t; t0 < end_t; t0 += block_size) {  // one block: up to block_size consecutive rows
        const int64_t first = int64_t(T[s * width + t0 / block_size]) * block_size * row, bytes = row * sizeof(*K);
        const auto* k = K + first;
        // this block's values (the next pass reads them) and the next block's keys, asked for ahead of use: the
        // blocks lie apart, where the CPU's prefetcher cannot guess them, and were last read a whole step ago
        const char* values = reinterpret_cast<const char*>(V + first);
        const char* next_keys = t0 + block_size >= end_t ? nullptr : reinterpret_cast<const char*>(
            K + int64_t(T[s * width + t0 / block_size + 1]) * block_size * row);
        for (int64_t t = t0; t < std::min(end_t, t0 + block_size); ++t, k += row) {
          for (int64_t line = (t - t0) * bytes; line < (t - t0 + 1) * bytes; line += 64) {  // row t's lines
            __builtin_prefetch(values + line);
            if (next_keys != nullptr) __builtin_prefetch(next_keys + line);
          }
          for (int64_t head = 0; head < num_heads; ++head) {
            const auto* kh = k + (head / group) * dim;  // grouped-query: heads of a group share a kv head
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < dim; ++d) dot += qs[head * dim + d] * widen(kh[d]);
            scores[head * n + t - first_t] = dot * fscale;
          }
        }
      }
// endregion

// region: values
      for (int64_t head = 0; head < num_heads; ++head) {  // exponentials of each head's scores, in place
        float* p = scores.data() + head * n;
        const float top = *std::max_element(p, p + n);
        float total = 0.f;
        #pragma omp simd reduction(+:total)  // with -ffast-math: the vector exp of glibc's libmvec
        for (int64_t t = 0; t < n; ++t) total += (p[t] = std::exp(p[t] - top));
        tops[item * num_heads + head] = top, totals[item * num_heads + head] = total;
      }
      float* acc = sums.data() + item * num_heads * dim;
      for (int64_t t0 = first_t; t0 < end_t; t0 += block_size) {  // the same rows again, for the values
        const auto* v = V + int64_t(T[s * width + t0 / block_size]) * block_size * row;
        for (int64_t t = t0; t < std::min(end_t, t0 + block_size); ++t, v += row)
          for (int64_t head = 0; head < num_heads; ++head) {
            const float p = scores[head * n + t - first_t];
            const auto* vh = v + (head / group) * dim;
            float* a = acc + head * dim;
            #pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += p * widen(vh[d]);
          }
      }
    }
  });
  };
  if (dtype == at::kFloat)
    attend(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else
    attend(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
// endregion

// region: merge
  // out = the items' sums of values over their totals, each item's rescaled to the sequence's largest score:
  // exp(score - top) = exp(score - item_top) * exp(item_top - top). One item per sequence: out = sums / total.
  at::parallel_for(0, num_seqs * num_heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t sh = begin; sh < end; ++sh) {
      const int64_t s = sh / num_heads, head = sh % num_heads;
      auto at = [&](int64_t part) { return (s * parts + part) * num_heads + head; };
      float top = tops[at(parts - 1)], total = 0.f;  // the last run is never empty: it ends the sequence
      for (int64_t part = 0; part < parts; ++part) if (totals[at(part)] > 0.f) top = std::max(top, tops[at(part)]);
      float* o = O + sh * dim;
      std::fill(o, o + dim, 0.f);
      for (int64_t part = 0; part < parts; ++part) {
        if (totals[at(part)] == 0.f) continue;  // an empty run
        const float weight = std::exp(tops[at(part)] - top);
        const float* a = sums.data() + at(part) * dim;
        total += weight * totals[at(part)];
        for (int64_t d = 0; d < dim; ++d) o[d] += weight * a[d];
      }
      for (int64_t d = 0; d < dim; ++d) o[d] /= total;
    }
  });
  return out.to(q.scalar_type());  // no copy when q is float32
}
// endregion

// region: write_kv
// Chapter 5's write_kv in one call: the caches [blocks, block_size, kv_heads, head_dim] seen as one row per slot,
// row slots[i] = k[i] and v[i] (this step's keys and values), one memcpy each
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
              v_cache.scalar_type() == dtype && k.scalar_type() == dtype && v.scalar_type() == dtype,
              "write_kv: the caches must be contiguous and alike, k and v of their dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "write_kv: slots must be int64 [tokens]");
  for (const auto& x : {k, v})
    TORCH_CHECK(x.dim() == 3 && x.size(0) == slots.size(0) && x.size(1) == k_cache.size(2) &&
                x.size(2) == k_cache.size(3), "write_kv: k and v must be [tokens, kv_heads, head_dim]");
  auto kc = k.contiguous(), vc = v.contiguous(), sc = slots.contiguous();
  const int64_t* S = sc.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t bytes = k_cache.size(2) * k_cache.size(3) * k.element_size();  // one token's row
  for (int64_t i = 0; i < sc.numel(); ++i)  // never write outside the cache, whatever the caller passes
    TORCH_CHECK(S[i] >= 0 && S[i] < num_slots, "write_kv: slot ", S[i], " is outside the cache");
  char *K = static_cast<char*>(k_cache.data_ptr()), *V = static_cast<char*>(v_cache.data_ptr());
  const char *k_rows = static_cast<const char*>(kc.data_ptr()), *v_rows = static_cast<const char*>(vc.data_ptr());
  for (int64_t i = 0; i < sc.numel(); ++i) {
    std::memcpy(K + S[i] * bytes, k_rows + i * bytes, bytes);
    std::memcpy(V + S[i] * bytes, v_rows + i * bytes, bytes);
  }
}
// endregion

// The Python module: TORCH_EXTENSION_NAME is set by minivllm/kernels/build.py, one name per build.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", torch::wrap_pybind_function(paged_decode), "paged_decode");
  m.def("write_kv", torch::wrap_pybind_function(write_kv), "write_kv");
}
