// Refits across simulated hosts (scripts/simhosts.sh), started the way a launcher starts ranks:
// `refit bench --launcher env` once per rank, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, each
// rank on its own host. Every transfer crosses a veth link over UCX tcp; no shared memory, no
// /proc of another host. Failures: a host whose processes all die, a link taken down, a partition
// that heals within the deadline.
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>

#include "sim_hosts.h"

namespace refit {
namespace {

using nlohmann::json;
using testing::read_file;
using testing::SimHosts;

// A small MoE (about 26 MiB of bf16) with tensors that split over the 4 MiB buckets used here.
const char* kModel = R"({
  "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "torch_dtype": "bfloat16",
  "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 4,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 16000,
  "num_experts": 16, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
  "rms_norm_eps": 1e-6, "tie_word_embeddings": false
})";

enum class Fault { kKillHost, kLinkDown };

class Hosts : public ::testing::Test {
 public:
  void SetUp() override {
    if (auto why = SimHosts::unavailable(); !why.empty()) GTEST_SKIP() << why;
    // In the build tree, which every simulated host sees (each has a private /tmp of its own).
    std::string pattern = (std::filesystem::current_path() / "hosts-XXXXXX").string();
    if (!mkdtemp(pattern.data())) FAIL() << "mkdtemp " << pattern << ": " << std::strerror(errno);
    dir_ = pattern;
    std::filesystem::create_directories(dir_);
    std::ofstream(dir_ + "/config.json") << kModel;
  }
  void TearDown() override {
    if (!dir_.empty() && !::testing::Test::HasFailure()) std::filesystem::remove_all(dir_);
  }

  struct Job {
    int status = -1;                        // rank 0's exit status; -1: it hung past the test's limit
    std::string output;                     // rank 0's output
    std::vector<std::string> rank_outputs;  // every rank's, rank 0 first
    std::vector<int> rank_status;
    json result;  // rank 0's --json

    // Every rank's exit status and output, for a failure message.
    std::string all_outputs() const {
      std::string out;
      for (size_t r = 0; r < rank_outputs.size(); ++r)
        out += "--- rank " + std::to_string(r) + " (exit " + std::to_string(rank_status[r]) + ")\n" + rank_outputs[r];
      return out;
    }
  };

  // Starts `sources + destinations` ranks, rank r on hosts[r], and lets them run; `during`, if
  // given, runs while they do (to inject a fault) and returns when it is done.
  Job run(SimHosts& hosts, const std::vector<int>& on_host, int sources, int destinations, int refits,
          std::vector<std::string> extra = {}, const std::function<void()>& during = {}, double limit_s = 120) {
    const int world = sources + destinations;
    const std::string port = std::to_string(29000 + (getpid() + run_count_++) % 2000);
    const std::string master = hosts.address(on_host[0]);
    const std::string json_path = dir_ + "/result.json";
    std::filesystem::remove(json_path);
    // A previous job's logs must be gone before `during` looks for refits in them: otherwise it
    // sees that job's rows and injects its fault before this job's ranks have even joined.
    for (int r = 0; r < world; ++r) std::filesystem::remove(log(r));
    std::vector<pid_t> pids;
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> argv = {"env",
                                       "RANK=" + std::to_string(r),
                                       "WORLD_SIZE=" + std::to_string(world),
                                       "MASTER_ADDR=" + master,
                                       "MASTER_PORT=" + port,
                                       REFIT_CLI_PATH,
                                       "bench",
                                       "--launcher",
                                       "env",
                                       "--model",
                                       dir_ + "/config.json",
                                       "--sources",
                                       std::to_string(sources),
                                       "--destinations",
                                       std::to_string(destinations),
                                       "--refits",
                                       std::to_string(refits),
                                       "refit_cfg.nixl.bucket_bytes=4MiB"};
      if (r == 0) argv.insert(argv.end(), {"--json", json_path});
      argv.insert(argv.end(), extra.begin(), extra.end());
      pids.push_back(hosts.start(on_host[r], argv, log(r)));
    }
    if (during) during();
    Job job;
    job.status = hosts.wait(pids[0], limit_s);
    for (int r = 0; r < world; ++r) {
      job.rank_status.push_back(r == 0 ? job.status : hosts.wait(pids[r], 30));
      job.rank_outputs.push_back(read_file(log(r)));
    }
    job.output = job.rank_outputs[0];
    if (std::filesystem::exists(json_path)) job.result = json::parse(read_file(json_path));
    return job;
  }

  std::string log(int rank) const { return dir_ + "/rank" + std::to_string(rank) + ".log"; }

  // Blocks until rank 0 has finished `refits` refits (its table rows), or the limit passes.
  bool wait_for_refits(int refits, double limit_s = 60) const {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit_s);
    const std::regex row(R"(\n\s+(\d+)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+\s+yes)");
    while (std::chrono::steady_clock::now() < end) {
      const std::string text = read_file(log(0));
      int done = 0;
      for (auto it = std::sregex_iterator(text.begin(), text.end(), row); it != std::sregex_iterator(); ++it) ++done;
      if (done >= refits) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  static void expect_verified(const Job& job, int destinations, int refits) {
    ASSERT_EQ(job.status, 0) << job.output;
    EXPECT_TRUE(job.result.at("verified").get<bool>()) << job.output;
    ASSERT_EQ(job.result.at("refits").size(), static_cast<size_t>(refits));
    for (const auto& refit : job.result.at("refits")) {
      ASSERT_EQ(refit.at("bytes_received").size(), static_cast<size_t>(destinations));
      for (const auto& d : refit.at("bytes_received")) {
        // Another host: the staged path over UCX's tcp transport on the host's link.
        EXPECT_FALSE(d.at("mapped").get<bool>());
        EXPECT_EQ(d.at("route").get<std::string>(), "UCX tcp/eth0") << d.dump();
        EXPECT_GT(d.at("bytes").get<uint64_t>(), 0u);
      }
    }
  }

  std::string dir_;
  int run_count_ = 0;
};

TEST_F(Hosts, TwoSourcesToTwoDestinationsOnFourHosts) {
  SimHosts hosts(4);
  auto job = run(hosts, {1, 2, 3, 4}, 2, 2, 3);
  expect_verified(job, 2, 3);
  std::vector<std::string> expected;
  for (int h = 1; h <= 4; ++h) expected.push_back(hosts.hostname(h));
  EXPECT_EQ(job.result.at("hosts").get<std::vector<std::string>>(), expected);
  EXPECT_EQ(job.result.at("launcher").get<std::string>(), "env");
  // Each destination logs the reference's line on its own host.
  EXPECT_NE(
      job.rank_outputs[2].find("[destination rank 0 on host " + hosts.hostname(3) + "] [info] [vLLM refit] Loaded"),
      std::string::npos)
      << job.rank_outputs[2];
}

TEST_F(Hosts, FourSourcesToTwoDestinationsOnSixHosts) {
  SimHosts hosts(6);
  auto job = run(hosts, {1, 2, 3, 4, 5, 6}, 4, 2, 2);
  expect_verified(job, 2, 2);
  for (int r = 0; r < 6; ++r) EXPECT_EQ(job.rank_status[r], 0) << job.rank_outputs[r];
}

// delta: auto across hosts (nothing maps there, so it is on): the first refit goes whole, the
// second tries changes; later ones go whichever way was faster, which depends on this machine's
// load (the policy itself is DeltaRefit.AutoSendsEachRefitTheWayThatWasFaster...). Every refit bitwise.
TEST_F(Hosts, DeltaAutoTriesChangesAcrossHosts) {
  SimHosts hosts(2, "1gbit");
  auto job = run(hosts, {1, 2}, 1, 1, 4, {"--changed", "0.01", "refit_cfg.nixl.delta=auto"});
  expect_verified(job, 1, 4);
  const auto& refits = job.result.at("refits");
  EXPECT_EQ(refits[0].at("bytes_received")[0].at("delta_tensors").get<uint64_t>(), 0u);
  const auto& second = refits[1].at("bytes_received")[0];
  EXPECT_GT(second.at("delta_tensors").get<uint64_t>(), 0u) << job.output;
  EXPECT_LT(second.at("wire_bytes").get<uint64_t>(), second.at("bytes").get<uint64_t>() / 10) << job.output;
}

// Delta refit when resharding across hosts: two TP-2 sources into four TP-4 destinations, so each
// source sends two destinations pieces that go by one name (each their whole slice) but come from
// different rows of its shard; the destinations read them from where the source packed them
// (direct reads across hosts). Every refit bitwise, changes only after the first.
TEST_F(Hosts, ReshardingDeltaAcrossHostsKeepsEachLinksPiecesApart) {
  SimHosts hosts(2, "1gbit");
  auto job = run(hosts, {1, 1, 2, 2, 2, 2}, 2, 4, 3,
                 {"--src-tp", "2", "--tp", "4", "--shard-dense", "--changed", "0.01", "refit_cfg.nixl.delta=true"});
  expect_verified(job, 4, 3);
  const auto& refits = job.result.at("refits");
  for (size_t k = 1; k < refits.size(); ++k)
    for (const auto& d : refits[k].at("bytes_received")) {
      EXPECT_GT(d.at("delta_tensors").get<uint64_t>(), 0u) << d.dump();
      EXPECT_LT(d.at("wire_bytes").get<uint64_t>(), d.at("bytes").get<uint64_t>() / 10) << d.dump();
    }
}

TEST_F(Hosts, ARankWithAnotherModelIsRefusedNamingItsHost) {
  SimHosts hosts(2);
  const std::string other = dir_ + "/other.json";
  std::string text = kModel;
  text.replace(text.find("\"num_hidden_layers\": 4"), 22, "\"num_hidden_layers\": 3");
  std::ofstream(other) << text;
  // Rank 1 is given another model: the same command line otherwise.
  const std::string master = hosts.address(1), port = "29977";
  auto argv = [&](int rank, const std::string& model) {
    return std::vector<std::string>{"env",
                                    "RANK=" + std::to_string(rank),
                                    "WORLD_SIZE=2",
                                    "MASTER_ADDR=" + master,
                                    "MASTER_PORT=" + port,
                                    REFIT_CLI_PATH,
                                    "bench",
                                    "--launcher",
                                    "env",
                                    "--model",
                                    model,
                                    "refit_cfg.nixl.timeout_s=20"};
  };
  pid_t p1 = hosts.start(2, argv(1, other), log(1));
  pid_t p0 = hosts.start(1, argv(0, dir_ + "/config.json"), log(0));
  EXPECT_NE(hosts.wait(p0, 60), 0);
  EXPECT_NE(hosts.wait(p1, 60), 0);
  const std::string out = read_file(log(0));
  EXPECT_NE(out.find("rank 1 on host " + hosts.hostname(2) + " cannot join: it has another model"), std::string::npos)
      << out;
}

TEST_F(Hosts, WrongWorldSizeIsRefusedBeforeAnyProcessJoins) {
  SimHosts hosts(1);
  pid_t p = hosts.start(1,
                        {"env", "RANK=0", "WORLD_SIZE=3", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29001", REFIT_CLI_PATH,
                         "bench", "--launcher", "env", "--sources", "1", "--destinations", "1"},
                        log(0));
  EXPECT_NE(hosts.wait(p, 30), 0);
  EXPECT_NE(read_file(log(0)).find("the launcher started 3 ranks, but 1 sources + 1 destinations need 2"),
            std::string::npos)
      << read_file(log(0));
}

// Seconds from `fault` to rank 0's "refit N failed" log line.
double detection_seconds(const std::string& output, std::chrono::system_clock::time_point fault) {
  std::smatch m;
  const std::regex line(R"(\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3})\] \[driver\] \[error\] refit \d+ failed)");
  if (!std::regex_search(output, m, line)) return -1;
  std::tm tm{};
  strptime(m[1].str().c_str(), "%Y-%m-%d %H:%M:%S", &tm);
  const auto at =
      std::chrono::system_clock::from_time_t(mktime(&tm)) + std::chrono::milliseconds(std::stoi(m[2].str()));
  return std::chrono::duration<double>(at - fault).count();
}

// One seeded trial: a refit runs over shaped links; at a random moment one host (a source's or a
// destination's, by the seed) dies or loses its link. The refit must fail within the deadline
// naming the lost peer's host, every other rank must exit (nothing hangs), and once the host is
// back a new job refits bitwise. Returns the detection time.
double trial(Hosts* test, SimHosts& hosts, Fault fault, uint32_t seed, double timeout_s) {
  std::mt19937 rng(seed);
  const int victim_rank = static_cast<int>(rng() % 3) + 1;  // ranks 1..3 (rank 0 drives)
  const int victim_host = victim_rank + 1;
  const double delay_s = std::uniform_real_distribution<double>(0.05, 0.5)(rng);
  std::chrono::system_clock::time_point at;
  auto job = test->run(hosts, {1, 2, 3, 4}, 2, 2, 40, {"refit_cfg.nixl.timeout_s=" + std::to_string(timeout_s)}, [&] {
    // After the first refit, part way into a later one.
    if (!test->wait_for_refits(1)) return;
    std::this_thread::sleep_for(std::chrono::duration<double>(delay_s));
    at = std::chrono::system_clock::now();
    if (fault == Fault::kKillHost)
      hosts.kill_host(victim_host);
    else
      hosts.link(victim_host, false);
  });
  EXPECT_NE(job.status, -1) << "rank 0 hung: " << job.output;
  EXPECT_EQ(job.status, 2) << "seed " << seed << ", victim rank " << victim_rank << "\n"
                           << job.all_outputs()
                           << (job.status == 2 ? "" : hosts.diagnose(victim_host) + hosts.diagnose(1));
  for (int r = 1; r < 4; ++r)
    if (r != victim_rank || fault == Fault::kLinkDown) EXPECT_NE(job.rank_status[r], -1) << "rank " << r << " hung";
  const std::string victim = victim_rank < 2 ? "source rank " + std::to_string(victim_rank)
                                             : "destination rank " + std::to_string(victim_rank - 2);
  EXPECT_NE(job.output.find(victim + " on host " + hosts.hostname(victim_host)), std::string::npos)
      << "seed " << seed << ": the error does not name " << victim << " on " << hosts.hostname(victim_host) << ":\n"
      << job.output;
  const double detected = detection_seconds(job.output, at);
  EXPECT_GE(detected, 0) << job.output;
  // The deadline, plus up to 2 s for the other ranks after a first failure, plus up to 2 s for the
  // driver's shutdown after a failed refit (closing a UCX connection to a lost peer is bounded by
  // 2 s) before the failure is reported, plus slack for slow (sanitized) builds.
  EXPECT_LE(detected, timeout_s + 5.0) << "seed " << seed << ": detected after " << detected << " s\n" << job.output;

  // The host comes back (a fresh one, for a host that died): a new job refits bitwise.
  if (fault == Fault::kKillHost)
    hosts.restart_host(victim_host);
  else
    hosts.link(victim_host, true);
  auto again = test->run(hosts, {1, 2, 3, 4}, 2, 2, 1);
  EXPECT_EQ(again.status, 0) << again.output;
  if (again.status == 0) EXPECT_TRUE(again.result.at("verified").get<bool>());
  return detected;
}

int trials_per_fault() {
  const char* n = std::getenv("REFIT_HOST_TRIALS");
  return n ? std::max(1, std::atoi(n)) : 3;
}

void report(const char* what, std::vector<double> seconds) {
  std::sort(seconds.begin(), seconds.end());
  if (seconds.empty()) return;
  std::printf("%s: %zu trials, detection median %.3f s, min %.3f s, max %.3f s\n", what, seconds.size(),
              seconds[seconds.size() / 2], seconds.front(), seconds.back());
}

// Seeded trials; REFIT_HOST_TRIALS sets how many of each (3 by default; 20 for the figures).
TEST_F(Hosts, AHostWhoseProcessesAllDieIsNamedAndAFreshHostRefitsBitwise) {
  SimHosts hosts(4, "1gbit");
  std::vector<double> seconds;
  for (int t = 0; t < trials_per_fault(); ++t) seconds.push_back(trial(this, hosts, Fault::kKillHost, 1000 + t, 10));
  report("host killed", seconds);
}

TEST_F(Hosts, AHostWhoseLinkGoesDownFailsTheRefitAtTheDeadline) {
  SimHosts hosts(4, "1gbit");
  std::vector<double> seconds;
  for (int t = 0; t < trials_per_fault(); ++t) seconds.push_back(trial(this, hosts, Fault::kLinkDown, 2000 + t, 3));
  report("link down", seconds);
}

TEST_F(Hosts, APartitionThatHealsWithinTheDeadlineDoesNotFailTheRefit) {
  SimHosts hosts(4, "1gbit");
  auto job = run(hosts, {1, 2, 3, 4}, 2, 2, 4, {"refit_cfg.nixl.timeout_s=20"}, [&] {
    if (!wait_for_refits(1)) return;
    hosts.link(4, false);  // destination rank 1's host, for 1.5 s
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    hosts.link(4, true);
  });
  expect_verified(job, 2, 4);
}

}  // namespace
}  // namespace refit
