// The built `flashcpp` binary, run as a user would: every bad numeric flag of every subcommand
// answers with a sentence on stderr and exit status 2 (never an abort, never a silent default),
// CLI11's own parse errors exit 2 as well, `flashcpp info` answers for shapes it could never
// allocate (run here under an address-space limit), and `flashcpp decode` on a tiny checkpoint
// refuses damaged weights and mismatched configs, checks --json before the run and prints every
// sequence. FLASHCPP_CLI_BINARY is the path of the binary (CMakeLists.txt; the environment
// variable of that name overrides it).
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "engine_tiny.h"

namespace fs = std::filesystem;
using namespace flashcpp;
using namespace flashcpp::engine;
using namespace flashcpp::engine::testing;

namespace {

struct Outcome {
  int status = -1;    ///< exit status; -1 when killed by a signal or timed out
  int signal = 0;     ///< the signal that ended it (SIGABRT for an uncaught exception)
  bool timed_out = false;
  double seconds = 0;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string show(const std::vector<std::string>& args) {
  std::string s = "flashcpp";
  for (const auto& a : args) s += " " + a;
  return s;
}

/// Runs the binary with `args`; with `address_space_bytes` > 0 under that RLIMIT_AS (ulimit -v).
Outcome run(const std::vector<std::string>& args, std::size_t address_space_bytes = 0, double timeout_s = 120) {
  static int counter = 0;
  static const struct Scratch {
    fs::path dir = fs::temp_directory_path() / ("flashcpp_cli_test_" + std::to_string(::getpid()));
    Scratch() { fs::create_directories(dir); }
    ~Scratch() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } scratch;
  const fs::path& dir = scratch.dir;
  const fs::path out = dir / ("out" + std::to_string(counter) + ".txt");
  const fs::path err = dir / ("err" + std::to_string(counter++) + ".txt");
  // FLASHCPP_CLI_BINARY in the environment runs another build (e.g. an older one, to see it fail).
  const char* bin = std::getenv("FLASHCPP_CLI_BINARY");
  std::vector<std::string> argv_s = {bin && *bin ? bin : FLASHCPP_CLI_BINARY};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int fo = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int fe = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fo < 0 || fe < 0) ::_exit(127);
    ::dup2(fo, 1);
    ::dup2(fe, 2);
    if (address_space_bytes > 0) {
      // A CUDA build's driver reserves address space for every GPU it sees; the limit is about
      // what info allocates, so the child sees none (its CUDA path allocates nothing either).
      ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
      rlimit rl{address_space_bytes, address_space_bytes};
      if (::setrlimit(RLIMIT_AS, &rl) != 0) ::_exit(126);
    }
    ::execv(argv[0], argv.data());
    ::_exit(125);
  }
  Outcome r;
  int ws = 0;
  for (;;) {
    const pid_t w = ::waitpid(pid, &ws, WNOHANG);
    if (w == pid) break;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &ws, 0);
      r.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!r.timed_out && WIFEXITED(ws)) r.status = WEXITSTATUS(ws);
  if (WIFSIGNALED(ws)) r.signal = WTERMSIG(ws);
  r.out = slurp(out);
  r.err = slurp(err);
  fs::remove(out);
  fs::remove(err);
  return r;
}

/// Exit status 2 with a sentence on stderr that contains `needle`, no crash, no output of a run.
void expect_usage_error(const std::vector<std::string>& args, const std::string& needle) {
  const Outcome r = run(args);
  EXPECT_EQ(r.status, 2) << show(args) << "\nstdout: " << r.out << "\nstderr: " << r.err;
  EXPECT_EQ(r.signal, 0) << show(args) << ": killed by signal " << r.signal << "\n" << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << show(args) << "\nstderr: " << r.err;
  EXPECT_EQ(r.err.find("terminate called"), std::string::npos) << show(args) << "\n" << r.err;
  EXPECT_EQ(r.out.find("prefill"), std::string::npos) << show(args) << ": it ran\n" << r.out;
}

std::vector<std::string> cat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// A tiny checkpoint written once for the decode tests (fp32, 2 layers, vocab 97).
const fs::path& tiny_model() {
  static const struct Holder {
    fs::path dir;
    ~Holder() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } h{[] {
    Tiny t;
    return write_tiny(&t, "cli", false, 11);
  }()};
  return h.dir;
}

/// A copy of the tiny checkpoint with `edit` applied to its weights (and config layers `layers`).
fs::path edited_model(const std::string& tag, const std::function<void(Tiny*)>& edit, int config_layers = -1) {
  Tiny t;
  const fs::path dir = write_tiny(&t, "cli_" + tag, false, 11);
  edit(&t);
  std::vector<StWriteTensor> ts;
  for (auto& [name, v] : t.w) ts.push_back(StWriteTensor{name, StDType::kF32, t.shape[name], v.data()});
  EXPECT_TRUE(write_safetensors((dir / "model.safetensors").string(), ts).ok());
  if (config_layers > 0) {
    Tiny c = t;
    c.layers = config_layers;
    std::ofstream(dir / "config.json") << config_json(c);
  }
  return dir;
}

const std::vector<std::string>& decode_cpu() {
  static const std::vector<std::string> a = {"decode", "--model", tiny_model().string(), "--backend", "cpu",
                                             "--eager"};
  return a;
}

}  // namespace

// ---- info: bad shapes, huge shapes ---------------------------------------------------------

// Each of these aborted with std::bad_alloc (SIGABRT): info allocated the shape it was asked about.
TEST(CliInfo, BadShapesAreRefusedWithASentence) {
  expect_usage_error({"info", "--seqlen-q", "-5"}, "--seqlen-q: must be an integer >= 1; got '-5'");
  expect_usage_error({"info", "--batch", "-1"}, "--batch: must be an integer >= 1");
  expect_usage_error({"info", "--head-dim", "-64"}, "--head-dim: must be a multiple of 8 in [8, 256]");
  expect_usage_error({"info", "--head-dim", "100000"}, "--head-dim: must be a multiple of 8 in [8, 256]");
  expect_usage_error({"info", "--head-dim", "84"}, "--head-dim: must be a multiple of 8 in [8, 256]; got '84'");
  expect_usage_error({"info", "--head-dim-v", "264"}, "--head-dim-v: must be a multiple of 8 in [8, 256]");
  expect_usage_error({"info", "--head-dim", "0"}, "--head-dim");
  expect_usage_error({"info", "--heads-q", "0"}, "--heads-q: must be an integer >= 1");
  // These fell back to the defaults without a word.
  expect_usage_error({"info", "--heads-kv", "-1"}, "--heads-kv: must be an integer >= 1");
  expect_usage_error({"info", "--seqlen-k", "-3"}, "--seqlen-k: must be an integer >= 1");
  expect_usage_error({"info", "--window-left", "-5"}, "--window-left: must be an integer >= -1");
  expect_usage_error({"info", "--window-right", "-2"}, "--window-right: must be an integer >= -1");
  expect_usage_error({"info", "--seqlen-q", "3000000000"}, "which is not an integer that fits in 32 bits");
  expect_usage_error({"info", "--batch", "x"}, "--batch");
  // Semantic checks: a sentence, status 2.
  expect_usage_error({"info", "--heads-q", "6", "--heads-kv", "4"}, "--heads-q 6 is not a multiple of --heads-kv 4");
  expect_usage_error({"info", "--batch", "2147483647", "--seqlen-q", "2147483647", "--heads-q", "2147483647",
                      "--head-dim", "256"},
                     "more than a 64-bit address space holds");
}

// Under a 1 GiB address-space limit (ulimit -v) info must still answer: it allocates nothing.
// The third shape is valid and 4 x 32 GiB; the first two are what the dispatcher refuses.
TEST(CliInfo, HugeShapesAnswerWithoutAllocating) {
  const std::size_t limit = std::size_t{1} << 30;
  const std::vector<std::vector<std::string>> shapes = {{"info", "--seqlen-q", "2000000000"},
                                                        {"info", "--batch", "1000000", "--seqlen-q", "1000000"},
                                                        {"info", "--batch", "64", "--seqlen-q", "65536"}};
  for (const auto& args : shapes) {
    const Outcome r = run(args, limit, 60);
    EXPECT_EQ(r.status, 0) << show(args) << "\n" << r.out << r.err;
    EXPECT_EQ(r.signal, 0) << show(args) << ": signal " << r.signal << "\n" << r.err;
    EXPECT_NE(r.out.find("kernel choice for"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("nothing is allocated"), std::string::npos) << r.out;
    EXPECT_EQ(r.err.find("bad_alloc"), std::string::npos) << r.err;
    EXPECT_LT(r.seconds, 30) << show(args);
  }
  const Outcome ok = run(shapes[2], limit, 60);
  EXPECT_NE(ok.out.find("cpu_tiled"), std::string::npos) << "the valid shape gets a kernel\n" << ok.out;
  EXPECT_NE(ok.out.find("q and o 32 GiB each"), std::string::npos) << ok.out;
  const Outcome big = run(shapes[0], limit, 60);
  EXPECT_NE(big.out.find("does not fit in int32"), std::string::npos) << "the dispatcher's answer\n" << big.out;
}

// The backward's choice for the same shape follows the forward's, for every backend (CUDA answers with
// its kernel where a device is, else with the sentence that says why), still without allocating.
TEST(CliInfo, TheBackwardChoiceIsPrintedForEveryBackend) {
  const std::vector<std::string> args = {"info", "--head-dim", "96", "--head-dim-v", "64", "--causal"};
  const Outcome r = run(args, std::size_t{1} << 30, 60);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  const std::size_t at = r.out.find("backward (dq, dk, dv) choice for the same problem:");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string tail = r.out.substr(at);
  EXPECT_NE(tail.find("cpu_tiled_online_softmax"), std::string::npos) << tail;
  EXPECT_NE(tail.find("cpu_reference_fp64"), std::string::npos) << tail;
  EXPECT_TRUE(tail.find("cuda_sm80_fa2 config bwd_") != std::string::npos ||
              tail.find("cuda_sm90_wgmma config bwd_sm90_") != std::string::npos ||
              tail.find("no usable CUDA device") != std::string::npos ||
              tail.find("no CUDA kernels") != std::string::npos || tail.find("this build leaves out") != std::string::npos)
      << tail;
}

// A decode step's split plan is printed with each small_plan (the CUDA planner's rule for an H200's 132
// SMs, walked on the host): B1 GQA 32/8 D128 over 2048 keys spreads over one full wave (32 splits,
// 256 CTAs) or 5/8 of the SMs (8 splits); a prefill-sized query block gets decode's own refusal.
TEST(CliInfo, TheDecodePlanIsPrintedForEachSmallPlan) {
  const Outcome r = run({"info", "--seqlen-q", "1", "--seqlen-k", "2048", "--heads-q", "32", "--heads-kv", "8"},
                        std::size_t{1} << 30, 60);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("small_plan full_wave: 32 split(s) a sequence at most, 32 work items, 256 CTAs (2 per SM)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("small_plan shared: 8 split(s) a sequence at most, 8 work items, 64 CTAs"), std::string::npos)
      << r.out;
  const Outcome big = run({"info"}, std::size_t{1} << 30, 60);
  EXPECT_EQ(big.status, 0) << big.out << big.err;
  EXPECT_NE(big.out.find("seqlen_q 4096 is outside the decode range"), std::string::npos) << big.out;
}

// ---- every subcommand's numeric flags; CLI11's exit codes ------------------------------------

TEST(CliFlags, EveryNumericFlagIsRangeChecked) {
  expect_usage_error({"check", "--threads", "-1", "--list"}, "--threads: must be an integer in [0, 1024]");
  expect_usage_error({"check", "--seed", "-5", "--list"}, "--seed: must be a non-negative integer");
  expect_usage_error({"audit", "--heads", "-2", "--list"}, "--heads: must be an integer >= 1");
  expect_usage_error({"audit", "--heads", "0", "--list"}, "--heads: must be an integer >= 1");
  expect_usage_error({"audit", "--head-dim", "0", "--list"}, "--head-dim: must be a multiple of 8 in [8, 256]");
  expect_usage_error({"audit", "--window", "-5", "--list"}, "--window: must be an integer >= 1");
  expect_usage_error({"audit", "--n", "128,0", "--list"}, "--n: must be an integer >= 1; got '0'");
  expect_usage_error({"audit", "--threads", "-1", "--list"}, "--threads: must be an integer in [0, 1024]");
  expect_usage_error({"audit", "--seed", "-1", "--list"}, "--seed");
  expect_usage_error({"audit", "--n", "1048576", "--heads", "64", "--list"}, "at most 2^30");
  expect_usage_error({"bench", "--iters", "0"}, "--iters: must be an integer >= 1");
  expect_usage_error({"bench", "--warmup", "-1"}, "--warmup: must be an integer >= 0");
  expect_usage_error({"bench", "--head-dims", "64,100"}, "--head-dims: must be one of 64, 128, 192, 256; got '100'");
  expect_usage_error({"tune", "--iters", "0"}, "--iters: must be an integer >= 1");
  expect_usage_error({"tune", "--head-dims", "32"}, "--head-dims: must be one of 64, 128, 256");
  const auto& d = decode_cpu();
  expect_usage_error(cat(d, {"--prompt-len", "4", "--temperature", "nan"}), "--temperature: must be a number >= 0; got 'nan'");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--temperature", "-1"}), "--temperature: must be a number >= 0");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--temperature", "inf"}), "--temperature");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--top-p", "0"}), "--top-p: must be a number in (0, 1]; got '0'");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--top-p", "2"}), "--top-p: must be a number in (0, 1]");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--top-p", "nan"}), "--top-p: must be a number in (0, 1]");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--threads", "-1"}), "--threads: must be an integer in [0, 1024]");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--batch", "0"}), "--batch: must be an integer in [1, 256]");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--batch", "257"}), "--batch: must be an integer in [1, 256]");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--max-new-tokens", "0"}), "--max-new-tokens: must be an integer >= 1");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--page-size", "3"}), "--page-size: must be a power of two in [1, 256]");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--seed", "-1"}), "--seed");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--decode-splits", "-1"}), "--decode-splits: must be an integer >= 0");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--decode-max-splits", "-1"}), "--decode-max-splits");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--trace-steps", "0"}), "--trace-steps: must be an integer >= 1");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--print-tokens", "-1"}), "--print-tokens: must be an integer >= 0");
  // These answered "give exactly one of ...", which hid the actual problem.
  expect_usage_error(cat(d, {"--prompt-len", "0"}), "--prompt-len: must be an integer >= 1; got '0'");
  expect_usage_error(cat(d, {"--context", "-1"}), "--context: must be an integer >= 1; got '-1'");
}

// CLI11's own exit codes are 100 and up (105 for a failed check, 109 for an unknown flag); a
// usage error is status 2 throughout. --help and --version stay 0.
TEST(CliFlags, ParseErrorsExitTwoAndHelpExitsZero) {
  expect_usage_error({"info", "--no-such-flag"}, "--no-such-flag");
  expect_usage_error({}, "subcommand");
  expect_usage_error({"chek", "--quick"}, "unknown subcommand 'chek'; the subcommands are info, check");
  expect_usage_error({"decode", "--prompt-len", "4"}, "--model");
  expect_usage_error({"decode", "--model", "", "--prompt-len", "4"}, "is empty: give a checkpoint directory");
  expect_usage_error({"check", "--backend", "gpu"}, "--backend");
  expect_usage_error({"check", "--quick", "--full"}, "excludes");
  const Outcome h = run({"info", "--help"});
  EXPECT_EQ(h.status, 0) << h.err;
  EXPECT_NE(h.out.find("--seqlen-q"), std::string::npos) << h.out;
  EXPECT_EQ(run({"--version"}).status, 0);
  const Outcome dh = run({"decode", "--help"});
  EXPECT_EQ(dh.status, 0);
  EXPECT_NE(dh.out.find("--print-tokens"), std::string::npos) << dh.out;
}

// ---- decode: semantic checks, damaged checkpoints, output ------------------------------------

TEST(CliDecode, UsageProblemsAreNamed) {
  const auto& d = decode_cpu();
  expect_usage_error(d, "no prompt");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--context", "8"}), "--prompt-len and --context were given together");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--gemm", "cublaslt"}),
                     "--gemm cublaslt selects a CUDA GEMM, but the run is on the CPU backend");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--decode-fused-merge"}), "CPU backend");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--prompt-file", "/nonexistent/prompts.txt"}), "given together");
  expect_usage_error(cat(d, {"--prompt-file", "/nonexistent/prompts.txt"}), "cannot open --prompt-file");
}

// --json to a path that cannot be written failed only after the whole run.
TEST(CliDecode, AnUnwritableJsonPathFailsBeforeTheRun) {
  const auto& d = decode_cpu();
  expect_usage_error(cat(d, {"--prompt-len", "4", "--json", "/nonexistent_dir_flashcpp/run.json"}),
                     "its folder /nonexistent_dir_flashcpp does not exist");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--json", fs::temp_directory_path().string()}), "is a directory");
  expect_usage_error(cat(d, {"--prompt-len", "4", "--dump-logits", "/nonexistent_dir_flashcpp/l.bin"}),
                     "--dump-logits");
  const fs::path ok = fs::temp_directory_path() / ("flashcpp_cli_json_" + std::to_string(::getpid()) + ".json");
  const Outcome r = run(cat(d, {"--prompt-len", "4", "--max-new-tokens", "3", "--json", ok.string()}));
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::exists(ok));
  fs::remove(ok);
}

// A NaN weight decoded token 0 forever without a word; an Inf likewise.
TEST(CliDecode, ANonFiniteWeightIsRefusedAtLoad) {
  const fs::path nan_dir = edited_model("nan", [](Tiny* t) {
    t->w["model.layers.1.mlp.up_proj.weight"][5 * 128 + 7] = std::numeric_limits<float>::quiet_NaN();
  });
  const Outcome r = run({"decode", "--model", nan_dir.string(), "--backend", "cpu", "--eager", "--prompt-len", "4"});
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("tensor 'model.layers.1.mlp.up_proj.weight' of the checkpoint holds a NaN at element 647 "
                       "(row 5, column 7)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("seq 0"), std::string::npos) << r.out;
  const fs::path inf_dir = edited_model("inf", [](Tiny* t) {
    t->w["model.embed_tokens.weight"][3] = std::numeric_limits<float>::infinity();
  });
  const Outcome r2 = run({"decode", "--model", inf_dir.string(), "--backend", "cpu", "--eager", "--prompt-len", "4"});
  EXPECT_EQ(r2.status, 2) << r2.err;
  EXPECT_NE(r2.err.find("'model.embed_tokens.weight' of the checkpoint holds an Inf at element 3"), std::string::npos)
      << r2.err;
  fs::remove_all(nan_dir);
  fs::remove_all(inf_dir);
}

// A config with fewer layers than the file ran the truncated model silently.
TEST(CliDecode, AConfigWithFewerLayersThanTheFileIsRefused) {
  const fs::path dir = edited_model("layers", [](Tiny*) {}, /*config_layers=*/1);
  const Outcome r = run({"decode", "--model", dir.string(), "--backend", "cpu", "--eager", "--prompt-len", "4"});
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("holds layers up to model.layers.1 (2 layers) but config.json says num_hidden_layers 1"),
            std::string::npos)
      << r.err;
  fs::remove_all(dir);
}

// Only 16 tokens of sequence 0 were printed, whatever the batch.
TEST(CliDecode, EverySequenceIsPrinted) {
  const auto& d = decode_cpu();
  const fs::path json = fs::temp_directory_path() / ("flashcpp_cli_seqs_" + std::to_string(::getpid()) + ".json");
  const Outcome r = run(cat(d, {"--batch", "3", "--prompt-len", "5", "--max-new-tokens", "20", "--json", json.string()}));
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string js = slurp(json);
  fs::remove(json);
  // The JSON's "tokens": [[...], [...], [...]]: each printed line must list the same ids.
  const auto at = js.find("\"tokens\"");
  ASSERT_NE(at, std::string::npos) << js;
  std::vector<std::vector<int>> tokens;
  {
    std::size_t i = js.find('[', at) + 1;
    while (true) {
      const std::size_t open = js.find('[', i), close_all = js.find(']', i);
      if (open == std::string::npos || close_all < open) break;
      const std::size_t close = js.find(']', open);
      std::vector<int> row;
      std::string body = js.substr(open + 1, close - open - 1);
      for (char& ch : body)
        if (ch == ',') ch = ' ';
      std::istringstream in(body);
      for (int v; in >> v;) row.push_back(v);
      tokens.push_back(row);
      i = close + 1;
    }
  }
  ASSERT_EQ(tokens.size(), 3u) << js;
  for (int b = 0; b < 3; ++b) {
    ASSERT_EQ(tokens[b].size(), 20u);
    std::string line = "seq " + std::to_string(b) + ":";
    for (int v : tokens[b]) line += " " + std::to_string(v);
    EXPECT_NE(r.out.find(line + "\n"), std::string::npos) << "missing: " << line << "\n" << r.out;
  }
  // Bounded per line, with a pointer to the rest.
  const Outcome cut = run(cat(d, {"--batch", "2", "--prompt-len", "5", "--max-new-tokens", "20", "--print-tokens", "3"}));
  ASSERT_EQ(cut.status, 0) << cut.err;
  EXPECT_NE(cut.out.find("seq 1: "), std::string::npos) << cut.out;
  EXPECT_NE(cut.out.find(" ... (20 tokens; --print-tokens 20 or --json for all)"), std::string::npos) << cut.out;
  const Outcome none = run(cat(d, {"--prompt-len", "5", "--max-new-tokens", "4", "--print-tokens", "0"}));
  ASSERT_EQ(none.status, 0) << none.err;
  EXPECT_EQ(none.out.find("seq 0"), std::string::npos) << none.out;
}

// ---- review of issue 25: what still ran silently ---------------------------------------------

// strtoull clamps a number past 2^64-1 to 2^64-1 (--seed 99999999999999999999999 ran with seed
// 18446744073709551615), and CLI11's base 0 read "010" as 8 and "0x10" as 16.
TEST(CliFlags, IntegersPastTheirTypeOrNotInDecimalAreRefused) {
  const std::string huge = "99999999999999999999999";
  expect_usage_error({"check", "--seed", huge, "--list"}, "--seed: must be a non-negative integer that fits in 64 bits");
  expect_usage_error({"audit", "--seed", huge, "--list"}, "--seed: must be a non-negative integer that fits in 64 bits");
  expect_usage_error(cat(decode_cpu(), {"--prompt-len", "4", "--seed", huge}), "--seed: must be a non-negative integer");
  expect_usage_error({"info", "--seqlen-q", "010"}, "--seqlen-q: must be an integer >= 1; got '010'");
  expect_usage_error({"info", "--batch", "0x10"}, "written in decimal");
  expect_usage_error({"check", "--threads", "0x4", "--list"}, "--threads");
  const Outcome ok = run({"check", "--seed", "18446744073709551615", "--list"});
  EXPECT_EQ(ok.status, 0) << ok.err;
  EXPECT_EQ(run({"info", "--seqlen-q", "+8", "--batch", "0"}).status, 2);
  EXPECT_EQ(run({"info", "--seqlen-q", "+8"}).status, 0);
}

// audit --kernels sm80 --backend cpu audited the CPU kernel instead, without a word.
TEST(CliAudit, AKernelOfTheOtherBackendIsRefused) {
  expect_usage_error({"audit", "--backend", "cpu", "--kernels", "sm80", "--list"},
                     "--kernels sm80 is a CUDA kernel, but the audit runs on the CPU backend (--backend cpu)");
  expect_usage_error({"audit", "--backend", "cpu", "--kernels", "cpu,sm90", "--list"}, "--kernels sm90 is a CUDA kernel");
  const Outcome ok = run({"audit", "--backend", "cpu", "--kernels", "cpu,decode", "--quick", "--list"});
  EXPECT_EQ(ok.status, 0) << ok.err;
  EXPECT_NE(ok.out.find("kernels: cpu cpu_decode"), std::string::npos) << ok.out;
}

// check --json to a path that cannot be written failed only after the whole run (minutes with
// --full); --cuda-config was dropped on the CPU backend.
TEST(CliCheck, AnUnwritableJsonPathOrACudaConfigOnTheCpuFailsBeforeTheRun) {
  const fs::path file = fs::temp_directory_path() / ("flashcpp_cli_file_" + std::to_string(::getpid()));
  std::ofstream(file) << "a file, not a folder\n";
  const std::vector<std::string> one = {"check", "--backend", "cpu", "--filter", "b2_h2_n1_d64_bf16"};
  expect_usage_error(cat(one, {"--json", (file / "report.json").string()}), "cannot write --json");
  const Outcome r = run(cat(one, {"--json", (file / "report.json").string()}));
  EXPECT_EQ(r.out.find("passed"), std::string::npos) << "it ran first:\n" << r.out;
  expect_usage_error(cat(one, {"--json", fs::temp_directory_path().string()}), "cannot write --json");
  expect_usage_error(cat(one, {"--cuda-config", "sm80"}), "--cuda-config sm80 picks a CUDA kernel config, but the run is on cpu");
  const fs::path ok = fs::temp_directory_path() / ("flashcpp_cli_check_" + std::to_string(::getpid()) + ".json");
  const Outcome w = run(cat(one, {"--json", ok.string()}));
  EXPECT_EQ(w.status, 0) << w.err;
  EXPECT_TRUE(fs::exists(ok));
  fs::remove(ok);
  fs::remove(file);
}

// bench --csv to a path that cannot be written timed everything and wrote nothing (exit 0);
// tune --out likewise, and printed "wrote". Without a GPU both named --backend cpu, a flag
// neither has.
TEST(CliBench, AnUnwritableOutputFailsFirstAndNoGpuNamesNoMissingFlag) {
  const fs::path file = fs::temp_directory_path() / ("flashcpp_cli_bfile_" + std::to_string(::getpid()));
  std::ofstream(file) << "a file, not a folder\n";
  const Outcome b = run({"bench", "--csv", (file / "b.csv").string()});
  const Outcome t = run({"tune", "--out", (file / "t.json").string()});
  const Outcome plain = run({"bench"});
  fs::remove(file);
  if (b.err.find("this build has no CUDA kernels") != std::string::npos) GTEST_SKIP() << "a CPU-only build";
  EXPECT_EQ(b.status, 2) << b.err;
  EXPECT_NE(b.err.find("flashcpp bench: --csv " + (file / "b.csv").string() + " cannot be written"), std::string::npos)
      << b.err;
  EXPECT_EQ(t.status, 2) << t.err;
  EXPECT_NE(t.err.find("flashcpp tune: --out " + (file / "t.json").string() + " cannot be written"), std::string::npos)
      << t.err;
  if (plain.status != 0) EXPECT_EQ(plain.err.find("--backend cpu)"), std::string::npos) << plain.err;
}

// --temperature 1e-40 (below FLT_MIN) made 1/temperature inf and sampled the vocabulary's last
// token forever with exit 0.
TEST(CliDecode, ATemperatureTooSmallToDivideByIsRefused) {
  expect_usage_error(cat(decode_cpu(), {"--prompt-len", "4", "--max-new-tokens", "3", "--temperature", "1e-40"}),
                     "temperature 1e-40 is too small to divide by");
  const Outcome ok = run(cat(decode_cpu(), {"--prompt-len", "4", "--max-new-tokens", "3", "--temperature", "1e-30"}));
  const Outcome greedy = run(cat(decode_cpu(), {"--prompt-len", "4", "--max-new-tokens", "3"}));
  ASSERT_EQ(ok.status, 0) << ok.err;
  ASSERT_EQ(greedy.status, 0) << greedy.err;
  const auto line = [](const std::string& s) { return s.substr(s.find("seq 0:")); };
  EXPECT_EQ(line(ok.out), line(greedy.out)) << "a tiny temperature is greedy";
}

// "context + new tokens exceed what the engine plans for" gave neither the numbers nor the limit.
TEST(CliDecode, TooLongAContextNamesTheLimit) {
  expect_usage_error(cat(decode_cpu(), {"--prompt-len", "2000000"}),
                     "a prompt of 2000000 tokens + 31 decode steps");
  expect_usage_error(cat(decode_cpu(), {"--context", "2000000"}), "max_position_embeddings 4096 and the engine's cap");
}

// --top-p with greedy decoding and --trace-steps without --trace were dropped without a word.
TEST(CliDecode, FlagsThatWouldBeIgnoredAreRefused) {
  expect_usage_error(cat(decode_cpu(), {"--prompt-len", "4", "--top-p", "0.5"}),
                     "--top-p 0.5 applies to sampling, but --temperature is 0");
  expect_usage_error(cat(decode_cpu(), {"--prompt-len", "4", "--trace-steps", "5"}), "--trace-steps requires --trace");
  const Outcome ok = run(cat(decode_cpu(), {"--prompt-len", "4", "--max-new-tokens", "2", "--top-p", "0.5",
                                            "--temperature", "0.7"}));
  EXPECT_EQ(ok.status, 0) << ok.err;
}

// Finite weights whose activations overflow in RMSNorm's sum of squares gave all-zero logits,
// and greedy decoded token 0 forever with exit 0 (the check looked for NaN and Inf only).
TEST(CliDecode, ConstantLogitsAreRefused) {
  const fs::path dir = edited_model("big", [](Tiny* t) {
    for (float& x : t->w["model.layers.0.mlp.down_proj.weight"]) x *= 1e37f;
  });
  const Outcome r = run({"decode", "--model", dir.string(), "--backend", "cpu", "--eager", "--prompt-len", "4"});
  fs::remove_all(dir);
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("the logits of sequence 0 after its prefill are all 0"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("seq 0"), std::string::npos) << r.out;
}
