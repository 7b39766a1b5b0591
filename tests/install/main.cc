// Runs one small attention problem on the CPU backend through the installed headers and library,
// and calls the public device, reference and half headers that the CLI and the harness use.
#include <flashcpp/attention.h>
#include <flashcpp/device.h>
#include <flashcpp/half.h>
#include <flashcpp/reference.h>
#include <flashcpp/tune.h>

#include <cstdio>
#include <vector>

int main() {
  const int n = 7, h = 2, d = 64;
  std::vector<float> q(n * h * d, 0.25f), k(n * h * d, 0.5f), v(n * h * d), o(n * h * d, -1.f);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 5);
  flashcpp::AttnParams p;
  p.batch = 1; p.seqlen_q = n; p.seqlen_k = n; p.heads_q = h; p.heads_kv = h; p.head_dim = d;
  p.q = flashcpp::bshd_view(q.data(), flashcpp::DType::kF32, n, h, d);
  p.k = flashcpp::bshd_view(k.data(), flashcpp::DType::kF32, n, h, d);
  p.v = flashcpp::bshd_view(v.data(), flashcpp::DType::kF32, n, h, d);
  p.o = flashcpp::bshd_view(o.data(), flashcpp::DType::kF32, n, h, d);
  p.mask.causal = true;
  flashcpp::RunOptions opt;
  opt.backend = flashcpp::Backend::kCpu;
  const flashcpp::Status st = flashcpp::attention_forward(p, opt);
  // Row 0 sees only key 0 (causal), so O[0] = V[0]; equal keys make every other row a mean of V rows.
  bool ok = st.ok() && o[0] == v[0] && o[d - 1] == v[d - 1];
  // The fp64 reference agrees on row 0; 1.5 survives an fp16 round trip; current_device answers
  // (a device, or a sentence saying why none: no GPU here, or a CPU-only build).
  flashcpp::cpu::RefOutput ref;
  ok = ok && flashcpp::cpu::reference_attention(p, &ref).ok() && ref.o[0] == v[0];
  ok = ok && flashcpp::half_bits_to_float(flashcpp::float_to_half_bits(1.5f)) == 1.5f;
  flashcpp::cuda::DeviceInfo dev;
  const flashcpp::Status ds = flashcpp::cuda::current_device(&dev);
  ok = ok && (ds.ok() ? dev.num_sms > 0 : !ds.message().empty());
  std::printf("consumer: %s (%s)\n", ok ? "ok" : "FAILED", st.to_string().c_str());
  return ok ? 0 : 1;
}
