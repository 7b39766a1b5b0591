// The kernel-timeline arithmetic of `flashcpp decode --trace` (tools/harness/kernel_trace.h): names,
// the critical-path split into launch gaps and busy time, the CSV. CUPTI itself needs a GPU.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "harness/kernel_trace.h"

using namespace flashcpp;
using namespace flashcpp::harness;

namespace {
KernelRecord rec(const std::string& name, std::uint64_t start, std::uint64_t end) {
  KernelRecord r;
  r.name = name;
  r.start_ns = start;
  r.end_ns = end;
  return r;
}
}  // namespace

TEST(HarnessTrace, ShortKernelNames) {
  EXPECT_EQ(short_kernel_name("void flashcpp::engine::(anonymous namespace)::gemv_kernel<1, __nv_bfloat16>("
                              "flashcpp::engine::(anonymous namespace)::GemvArgs)"),
            "gemv_kernel<1, __nv_bfloat16>");
  EXPECT_EQ(short_kernel_name("void flashcpp::cuda::decode_dev::decode_split_kernel<128, __nv_bfloat16>("
                              "flashcpp::cuda::DecodeKernelParams)"),
            "decode_split_kernel<128, __nv_bfloat16>");
  EXPECT_EQ(short_kernel_name("void ns::f<ns::A<2>, ns::B>(int, ns::C<3>)"), "f<ns::A<2>, ns::B>");
  EXPECT_EQ(short_kernel_name("plain_c_kernel"), "plain_c_kernel");  // not mangled: unchanged
  EXPECT_EQ(short_kernel_name("void (anonymous namespace)::k(int)"), "k");
}

TEST(HarnessTrace, CriticalPathSplitsGapsAndBusyTime) {
  // a: 0-10 us; b launched 2 us after a ended (gap 2, busy 3); c launched programmatically at 13 us,
  // before b ended at 15: no gap, busy 15-20 = 5 (its span 13-20 = 7 includes the wait); a again.
  std::vector<KernelRecord> r = {rec("a", 0, 10000), rec("b", 12000, 15000), rec("c", 13000, 20000),
                                 rec("a", 21000, 22000)};
  const TraceSummary t = summarize(r);
  EXPECT_DOUBLE_EQ(t.wall_us, 22.0);
  EXPECT_DOUBLE_EQ(t.gap_us, 3.0);
  EXPECT_DOUBLE_EQ(t.busy_us, 19.0);
  EXPECT_DOUBLE_EQ(t.gap_us + t.busy_us, t.wall_us);  // the split covers the wall time exactly
  ASSERT_EQ(t.by_name.size(), 3u);
  EXPECT_EQ(t.by_name[0].name, "a");  // largest share first: a 10 + 1 busy + 1 gap
  EXPECT_EQ(t.by_name[0].count, 2);
  EXPECT_DOUBLE_EQ(t.by_name[0].busy_us, 11.0);
  EXPECT_DOUBLE_EQ(t.by_name[0].gap_us, 1.0);
  const KernelShare& c = t.by_name[1].name == "c" ? t.by_name[1] : t.by_name[2];
  EXPECT_DOUBLE_EQ(c.gap_us, 0.0);
  EXPECT_DOUBLE_EQ(c.busy_us, 5.0);
  EXPECT_DOUBLE_EQ(c.duration_us, 7.0);
  EXPECT_TRUE(summarize({}).by_name.empty());
}

TEST(HarnessTrace, CsvHasOneLinePerKernel) {
  std::vector<KernelRecord> r = {rec("k<1, float>", 1000, 3000), rec("m", 5000, 6000)};
  r[0].grid[0] = 396;
  r[0].block[0] = 256;
  const std::string path = (std::filesystem::temp_directory_path() / "flashcpp_trace_test.csv").string();
  ASSERT_TRUE(write_trace_csv(r, path).ok());
  std::ifstream f(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(f, l);) lines.push_back(l);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0], "index,name,start_us,end_us,duration_us,gap_us,busy_us,grid,block,registers,graph_id");
  EXPECT_EQ(lines[1], "0,k<1; float>,0.000,2.000,2.000,0.000,2.000,396x0x0,256x0x0,0,0");
  EXPECT_EQ(lines[2], "1,m,4.000,5.000,1.000,2.000,1.000,0x0x0,0x0x0,0,0");
  std::filesystem::remove(path);
  EXPECT_FALSE(write_trace_csv(r, "/nonexistent-dir/x.csv").ok());
}
