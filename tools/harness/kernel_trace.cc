// CUPTI kernel timeline (kernel_trace.h). The summary and the CSV are plain C++ (tested on the
// CPU); only trace_begin / trace_end need CUPTI.
#include "kernel_trace.h"

#include <cxxabi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>

#if FLASHCPP_HAS_CUPTI
#include <cupti.h>
#endif

namespace flashcpp::harness {

std::string short_kernel_name(const std::string& demangled) {
  std::string s = demangled;
  if (s.rfind("void ", 0) == 0) s = s.substr(5);
  // Drop the parameter list: the '(' that closes the name at template depth 0, scanning from the end.
  int depth = 0;
  for (std::size_t i = s.size(); i-- > 0;) {
    const char ch = s[i];
    if (ch == ')') ++depth;
    else if (ch == '(' && --depth == 0) {
      // "(anonymous namespace)" is part of the qualified name, not a parameter list
      if (s.compare(i, 21, "(anonymous namespace)") != 0) {
        s = s.substr(0, i);
        break;
      }
    }
  }
  // Drop the namespaces: everything up to the last "::" outside template arguments.
  depth = 0;
  std::size_t cut = 0;
  for (std::size_t i = 0; i + 1 < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    else if (s[i] == '>') --depth;
    else if (depth == 0 && s[i] == ':' && s[i + 1] == ':') cut = i + 2;
  }
  return s.substr(cut);
}

namespace {

double us(std::uint64_t ns) { return 1e-3 * static_cast<double>(ns); }

/// Kernel i's place on the critical path (kernel_trace.h): launch gap and busy time, in us.
struct PathShare {
  double gap_us = 0, busy_us = 0;
};
std::vector<PathShare> critical_path(const std::vector<KernelRecord>& records) {
  std::vector<PathShare> out(records.size());
  std::uint64_t prev_end = records.empty() ? 0 : records.front().start_ns;
  for (std::size_t i = 0; i < records.size(); ++i) {
    const KernelRecord& r = records[i];
    const std::uint64_t begin = std::max(r.start_ns, prev_end);
    out[i].gap_us = r.start_ns > prev_end ? us(r.start_ns - prev_end) : 0.0;
    out[i].busy_us = r.end_ns > begin ? us(r.end_ns - begin) : 0.0;
    prev_end = std::max(prev_end, r.end_ns);
  }
  return out;
}

}  // namespace

TraceSummary summarize(const std::vector<KernelRecord>& records) {
  TraceSummary t;
  if (records.empty()) return t;
  const std::vector<PathShare> path = critical_path(records);
  std::map<std::string, KernelShare> by;
  std::uint64_t last_end = 0;
  for (std::size_t i = 0; i < records.size(); ++i) {
    const KernelRecord& r = records[i];
    KernelShare& k = by[r.name];
    k.name = r.name;
    ++k.count;
    k.gap_us += path[i].gap_us;
    k.busy_us += path[i].busy_us;
    k.duration_us += r.end_ns > r.start_ns ? us(r.end_ns - r.start_ns) : 0.0;
    t.gap_us += path[i].gap_us;
    t.busy_us += path[i].busy_us;
    last_end = std::max(last_end, r.end_ns);
  }
  t.wall_us = us(last_end - records.front().start_ns);
  for (auto& [name, k] : by) t.by_name.push_back(k);
  std::sort(t.by_name.begin(), t.by_name.end(), [](const KernelShare& a, const KernelShare& b) {
    return a.busy_us + a.gap_us != b.busy_us + b.gap_us ? a.busy_us + a.gap_us > b.busy_us + b.gap_us : a.name < b.name;
  });
  return t;
}

Status write_trace_csv(const std::vector<KernelRecord>& records, const std::string& path) {
  std::ofstream f(path);
  if (!f) return Status::Invalid("cannot write the trace to " + path);
  f << "index,name,start_us,end_us,duration_us,gap_us,busy_us,grid,block,registers,graph_id\n";
  const std::uint64_t t0 = records.empty() ? 0 : records.front().start_ns;
  const std::vector<PathShare> share = critical_path(records);
  char buf[160];
  for (std::size_t i = 0; i < records.size(); ++i) {
    const KernelRecord& r = records[i];
    std::snprintf(buf, sizeof(buf), ",%.3f,%.3f,%.3f,%.3f,%.3f,", us(r.start_ns - t0), us(r.end_ns - t0),
                  us(r.end_ns - r.start_ns), share[i].gap_us, share[i].busy_us);
    std::string name = r.name;
    std::replace(name.begin(), name.end(), ',', ';');  // template arguments: keep the CSV's columns
    f << i << ',' << name << buf << r.grid[0] << 'x' << r.grid[1] << 'x' << r.grid[2] << ',' << r.block[0] << 'x'
      << r.block[1] << 'x' << r.block[2] << ',' << r.registers << ',' << r.graph_id << '\n';
  }
  f.flush();  // a full disk shows at the flush, not at the buffered writes
  return f ? Status::Ok() : Status::Invalid("writing the trace to " + path + " failed");
}

#if FLASHCPP_HAS_CUPTI
namespace {

std::mutex g_mu;
std::vector<KernelRecord> g_records;
bool g_callbacks = false;
constexpr std::size_t kBufferBytes = 8u << 20;

std::string demangle(const char* name) {
  if (name == nullptr) return "?";
  int st = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(name, nullptr, nullptr, &st), std::free);
  return st == 0 && d ? std::string(d.get()) : std::string(name);
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::vector<KernelRecord> got;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    KernelRecord r;
    r.name = short_kernel_name(demangle(k->name));
    r.start_ns = k->start;
    r.end_ns = k->end;
    r.grid[0] = k->gridX, r.grid[1] = k->gridY, r.grid[2] = k->gridZ;
    r.block[0] = k->blockX, r.block[1] = k->blockY, r.block[2] = k->blockZ;
    r.registers = k->registersPerThread;
    r.graph_id = k->graphId;
    got.push_back(std::move(r));
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  g_records.insert(g_records.end(), got.begin(), got.end());
}

Status cupti_status(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return Status::Ok();
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  return Status::Internal(std::string(what) + " failed: " + (msg ? msg : "unknown CUPTI error"));
}

}  // namespace

Status trace_begin() {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_records.clear();
  }
  if (!g_callbacks) {
    FLASHCPP_RETURN_IF_ERROR(
        cupti_status(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks"));
    g_callbacks = true;
  }
  return cupti_status(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable(CONCURRENT_KERNEL)");
}

Status trace_end(std::vector<KernelRecord>* out) {
  FLASHCPP_RETURN_IF_ERROR(cupti_status(cuptiActivityFlushAll(1), "cuptiActivityFlushAll"));
  FLASHCPP_RETURN_IF_ERROR(
      cupti_status(cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityDisable(CONCURRENT_KERNEL)"));
  std::lock_guard<std::mutex> lock(g_mu);
  *out = std::move(g_records);
  g_records.clear();
  std::sort(out->begin(), out->end(), [](const KernelRecord& a, const KernelRecord& b) { return a.start_ns < b.start_ns; });
  return Status::Ok();
}
#else
Status trace_begin() {
  return Status::Unsupported("this build has no CUPTI (configure with the CUDA toolkit's CUPTI to trace kernels)");
}
Status trace_end(std::vector<KernelRecord>* out) {
  out->clear();
  return Status::Unsupported("this build has no CUPTI");
}
#endif

}  // namespace flashcpp::harness
