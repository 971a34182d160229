"""A hand-written AVX2/FMA AdamW step (C++, built once with torch.utils.cpp_extension, cached in
TORCH_EXTENSIONS_DIR): one pass over memory, 8 floats per instruction, torch's thread pool
(at::parallel_for), the GIL released. Per element it reads the fp32 master weight, the gradient
(fp32, bf16 or fp16) and both moments once, and writes the master weight, both moments and, in mixed
precision, the bf16/fp16 weight (round to nearest even) once.

Arithmetic: torch's fused CPU AdamW (decoupled decay first; lerp for the first moment; bias
corrections from `step`), except that `sqrt(v) / sqrt(bc2)` is computed as `sqrt(v) * (1/sqrt(bc2))`:
one division per element instead of two, which keeps the kernel at the memory's speed on 2-core
machines where two divisions and a square root per element are not free.

Built only where the CPU has AVX2, FMA and F16C and a compiler and ninja are present; otherwise
`load()` returns None and hpctrain.offload.adam_kernel uses torch.compile or torch's fused AdamW.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

from hpctrain.offload.kernel_cache import use_private_cache

log = logging.getLogger("hpctrain")

_lock = threading.Lock()
_module = None
_failed: Optional[str] = None

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

namespace {

constexpr int64_t GRAIN = 1 << 16;  // elements per task of the thread pool

struct Hyper {
  float decay, b1c, b2, b2c, step_size, inv_bc2s, eps;
};

// ---- scalar helpers (tails)
inline float bf16_to_f(uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t f_to_bf16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  u += 0x7FFF + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}
inline float half_to_f(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f_to_half(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

// ---- 8-wide loads/stores by type
struct F32 { using T = float;
  static inline __m256 load(const T* p) { return _mm256_loadu_ps(p); }
  static inline float get(const T* p) { return *p; } };
struct BF16 { using T = uint16_t;
  static inline __m256 load(const T* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
  static inline float get(const T* p) { return bf16_to_f(*p); }
  static inline void store(T* p, __m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi)); }
  static inline void put(T* p, float f) { *p = f_to_bf16(f); } };
struct F16 { using T = uint16_t;
  static inline __m256 load(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static inline float get(const T* p) { return half_to_f(*p); }
  static inline void store(T* p, __m256 x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); }
  static inline void put(T* p, float f) { *p = f_to_half(f); } };
struct NoOut { using T = uint16_t;
  static inline void store(T*, __m256) {}
  static inline void put(T*, float) {} };

template <class G, class O>
void adam_range(float* __restrict p, const typename G::T* __restrict g, float* __restrict m,
                float* __restrict v, typename O::T* __restrict out, int64_t lo, int64_t hi, Hyper h) {
  const __m256 decay = _mm256_set1_ps(h.decay), b1c = _mm256_set1_ps(h.b1c), b2 = _mm256_set1_ps(h.b2),
               b2c = _mm256_set1_ps(h.b2c), ss = _mm256_set1_ps(h.step_size),
               ib = _mm256_set1_ps(h.inv_bc2s), eps = _mm256_set1_ps(h.eps);
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    __m256 gv = G::load(g + i);
    __m256 pv = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
    __m256 mv = _mm256_loadu_ps(m + i);
    mv = _mm256_fmadd_ps(b1c, _mm256_sub_ps(gv, mv), mv);                      // lerp(m, g, 1 - b1)
    __m256 vv = _mm256_fmadd_ps(_mm256_mul_ps(gv, gv), b2c, _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
    __m256 den = _mm256_fmadd_ps(_mm256_sqrt_ps(vv), ib, eps);                   // sqrt(v)/sqrt(bc2) + eps
    pv = _mm256_sub_ps(pv, _mm256_div_ps(_mm256_mul_ps(ss, mv), den));
    _mm256_storeu_ps(p + i, pv);
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
    O::store(out + i, pv);
  }
  for (; i < hi; ++i) {
    float gv = G::get(g + i);
    float pv = p[i] * h.decay;
    float mv = std::fma(h.b1c, gv - m[i], m[i]);
    float vv = std::fma(gv * gv, h.b2c, v[i] * h.b2);
    float den = std::fma(std::sqrt(vv), h.inv_bc2s, h.eps);
    pv = pv - (h.step_size * mv) / den;
    p[i] = pv; m[i] = mv; v[i] = vv;
    O::put(out + i, pv);
  }
}

void check(const torch::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == n, name,
              " must be a contiguous CPU tensor of ", n, " elements");
}

Hyper make_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, double step_size,
                 double bc2_sqrt) {
  return Hyper{float(1.0 - lr * weight_decay), float(1.0 - beta1), float(beta2), float(1.0 - beta2),
               float(step_size), float(1.0 / bc2_sqrt), float(eps)};
}

template <class G, class O>
void range_typed(const torch::Tensor& p, const torch::Tensor& g, const torch::Tensor& m, const torch::Tensor& v,
                 const torch::Tensor* out, int64_t lo, int64_t hi, const Hyper& h) {
  adam_range<G, O>(p.data_ptr<float>(), reinterpret_cast<const typename G::T*>(g.data_ptr()), m.data_ptr<float>(),
                   v.data_ptr<float>(), out ? reinterpret_cast<typename O::T*>(out->data_ptr()) : nullptr, lo, hi, h);
}

template <class G>
void range_out(const torch::Tensor& p, const torch::Tensor& g, const torch::Tensor& m, const torch::Tensor& v,
               const torch::Tensor* out, int64_t lo, int64_t hi, const Hyper& h) {
  if (!out) return range_typed<G, NoOut>(p, g, m, v, nullptr, lo, hi, h);
  if (out->scalar_type() == at::kBFloat16) return range_typed<G, BF16>(p, g, m, v, out, lo, hi, h);
  return range_typed<G, F16>(p, g, m, v, out, lo, hi, h);
}

// elements [lo, hi) of one tensor set
void range_any(const torch::Tensor& p, const torch::Tensor& g, const torch::Tensor& m, const torch::Tensor& v,
               const torch::Tensor* out, int64_t lo, int64_t hi, const Hyper& h) {
  switch (g.scalar_type()) {
    case at::kFloat: return range_out<F32>(p, g, m, v, out, lo, hi, h);
    case at::kBFloat16: return range_out<BF16>(p, g, m, v, out, lo, hi, h);
    default: return range_out<F16>(p, g, m, v, out, lo, hi, h);
  }
}

void validate(const torch::Tensor& p, const torch::Tensor& g, const torch::Tensor& m, const torch::Tensor& v,
              const torch::Tensor* out) {
  int64_t n = p.numel();
  check(p, "p", n); check(g, "g", n); check(m, "m", n); check(v, "v", n);
  TORCH_CHECK(p.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "p, m, v must be fp32");
  auto gt = g.scalar_type();
  TORCH_CHECK(gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf, "g must be fp32, bf16 or fp16");
  if (out) {
    check(*out, "out", n);
    TORCH_CHECK(out->scalar_type() == at::kBFloat16 || out->scalar_type() == at::kHalf, "out must be bf16 or fp16");
  }
}

void adam_step(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v,
               c10::optional<torch::Tensor> out, double lr, double beta1, double beta2, double eps,
               double weight_decay, double step_size, double bc2_sqrt) {
  const torch::Tensor* o = out.has_value() ? &*out : nullptr;
  validate(p, g, m, v, o);
  Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt);
  at::parallel_for(0, p.numel(), GRAIN, [&](int64_t lo, int64_t hi) { range_any(p, g, m, v, o, lo, hi, h); });
}

// Many tensors (same hyperparameters and step) in one parallel region: one fork/join per call instead
// of one per tensor, and the threads share the work evenly whatever the tensor sizes.
void adam_multi(std::vector<torch::Tensor> p, std::vector<torch::Tensor> g, std::vector<torch::Tensor> m,
                std::vector<torch::Tensor> v, std::vector<torch::Tensor> out, double lr, double beta1, double beta2,
                double eps, double weight_decay, double step_size, double bc2_sqrt) {
  size_t k = p.size();
  TORCH_CHECK(g.size() == k && m.size() == k && v.size() == k && (out.empty() || out.size() == k),
              "adam_multi: lists of different lengths");
  std::vector<int64_t> start(k + 1, 0);
  for (size_t i = 0; i < k; ++i) {
    validate(p[i], g[i], m[i], v[i], out.empty() ? nullptr : &out[i]);
    start[i + 1] = start[i] + p[i].numel();
  }
  Hyper h = make_hyper(lr, beta1, beta2, eps, weight_decay, step_size, bc2_sqrt);
  at::parallel_for(0, start[k], GRAIN, [&](int64_t lo, int64_t hi) {
    size_t i = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (; i < k && start[i] < hi; ++i) {
      int64_t a = std::max(lo, start[i]) - start[i], b = std::min(hi, start[i + 1]) - start[i];
      if (a < b) range_any(p[i], g[i], m[i], v[i], out.empty() ? nullptr : &out[i], a, b, h);
    }
  });
}

// The ceiling for benchmarks: Adam's traffic (read p, g, m, v; write p, m, v [, out]) with one add each.
template <bool OUT>
void memory_range(float* __restrict pp, const float* __restrict gp, float* __restrict mp, float* __restrict vp,
                  uint16_t* __restrict op, int64_t lo, int64_t hi) {
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {
    __m256 gv = _mm256_loadu_ps(gp + i);
    __m256 pv = _mm256_add_ps(_mm256_loadu_ps(pp + i), gv);
    __m256 mv = _mm256_add_ps(_mm256_loadu_ps(mp + i), gv);
    __m256 vv = _mm256_add_ps(_mm256_loadu_ps(vp + i), gv);
    _mm256_storeu_ps(pp + i, pv);
    _mm256_storeu_ps(mp + i, mv);
    _mm256_storeu_ps(vp + i, vv);
    if (OUT) BF16::store(op + i, pv);
  }
  for (; i < hi; ++i) {
    pp[i] += gp[i]; mp[i] += gp[i]; vp[i] += gp[i];
    if (OUT) op[i] = f_to_bf16(pp[i]);
  }
}

void memory_only(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v,
                 c10::optional<torch::Tensor> out) {
  int64_t n = p.numel();
  check(p, "p", n); check(g, "g", n); check(m, "m", n); check(v, "v", n);
  float* pp = p.data_ptr<float>(); float* mp = m.data_ptr<float>(); float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  uint16_t* op = out.has_value() ? reinterpret_cast<uint16_t*>(out->data_ptr()) : nullptr;
  at::parallel_for(0, n, GRAIN, [&](int64_t lo, int64_t hi) {
    if (op) memory_range<true>(pp, gp, mp, vp, op, lo, hi);
    else memory_range<false>(pp, gp, mp, vp, op, lo, hi);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("adam_step", &adam_step, py::call_guard<py::gil_scoped_release>());
  mod.def("adam_multi", &adam_multi, py::call_guard<py::gil_scoped_release>());
  mod.def("memory_only", &memory_only, py::call_guard<py::gil_scoped_release>());
}
"""


def _cpu_ok() -> Optional[str]:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return "no /proc/cpuinfo"
    missing = [f for f in ("avx2", "fma", "f16c") if f" {f}" not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def load(verbose: bool = False):
    """The built extension, or None (with the reason in `failure()`)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        why = _cpu_ok()
        if why is None:
            try:
                # imports setuptools, which may be absent: a failed import falls back like a failed build
                from torch.utils.cpp_extension import load_inline, verify_ninja_availability

                verify_ninja_availability()
                use_private_cache("TORCH_EXTENSIONS_DIR", "torch_extensions")
                _module = load_inline("hpctrain_adam_avx2", cpp_sources=[SOURCE], functions=None,
                                      # -fopenmp: at::parallel_for is inline and runs serially without it
                                      extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fno-math-errno", "-fopenmp"],
                                      extra_ldflags=["-fopenmp"], verbose=verbose)
                return _module
            except Exception as e:  # no compiler, no ninja, a build error
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        _failed = why
        log.info("hpctrain's C++ AdamW kernel is unavailable (%s)", why)
        return None


def failure() -> Optional[str]:
    return _failed
