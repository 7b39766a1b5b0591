#include "cuda/prefill/fa2_tuning.h"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <tuple>

#include <nlohmann/json.hpp>

namespace flashcpp::cuda {

namespace {

struct TableRow {
  int sm, head_dim;
  bool causal;
  DType dtype;
  int bucket;
  const char* config;
};
constexpr DType bf16 = DType::kBF16, fp16 = DType::kF16;
const TableRow kShipped[] = {
#include "cuda/prefill/fa2_tuned_table.inc"
    {0, 0, false, DType::kF32, 0, ""},  // sentinel
};

using Key = std::tuple<int, bool, int, int>;  // head_dim, causal, dtype, bucket

std::map<Key, std::string> load_cache(const std::string& path) {
  std::map<Key, std::string> out;
  std::ifstream in(path);
  if (!in) return out;
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    for (const auto& e : j.at("entries")) {
      const std::string dt = e.at("dtype").get<std::string>();
      const int dtc = dt == "bf16" ? static_cast<int>(DType::kBF16) : static_cast<int>(DType::kF16);
      out[{e.at("head_dim").get<int>(), e.at("causal").get<bool>(), dtc, e.at("bucket").get<int>()}] =
          e.at("config").get<std::string>();
    }
  } catch (const std::exception&) {
    out.clear();  // a corrupt cache is ignored, never fatal
  }
  return out;
}

}  // namespace

int seqlen_bucket(int seqlen) {
  int b = 0;
  for (int ub : kSeqlenBuckets) {
    if (seqlen <= ub) return b;
    ++b;
  }
  return b;
}

std::string seqlen_bucket_name(int bucket) {
  constexpr int n = sizeof(kSeqlenBuckets) / sizeof(kSeqlenBuckets[0]);
  if (bucket < n) return "le" + std::to_string(kSeqlenBuckets[bucket]);
  return "gt" + std::to_string(kSeqlenBuckets[n - 1]);
}

std::string tune_cache_path(const DeviceInfo& dev) {
  if (const char* p = std::getenv("FLASHCPP_TUNE_CACHE")) return p;
  std::string name;
  for (char c : dev.name) name += (std::isalnum(static_cast<unsigned char>(c)) ? c : '_');
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/flashcpp/prefill_sm80_" + name + ".json";
}

std::string tuned_config(const DeviceInfo& dev, int head_dim, bool causal, DType dtype, int seqlen) {
  static std::mutex mu;
  static std::map<std::string, std::map<Key, std::string>> caches;  // per cache path
  const Key key{head_dim, causal, static_cast<int>(dtype), seqlen_bucket(seqlen)};
  {
    const std::string path = tune_cache_path(dev);
    std::lock_guard<std::mutex> lock(mu);
    auto it = caches.find(path);
    if (it == caches.end()) it = caches.emplace(path, load_cache(path)).first;
    auto hit = it->second.find(key);
    if (hit != it->second.end()) return hit->second;
  }
  const int sm = dev.sm_major * 10 + dev.sm_minor;
  for (const auto& r : kShipped)
    if (r.sm == sm && r.head_dim == head_dim && r.causal == causal && r.dtype == dtype &&
        r.bucket == std::get<3>(key))
      return r.config;
  return {};
}

}  // namespace flashcpp::cuda
