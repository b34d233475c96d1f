// The driver's lifecycle over a fake WorkerGroup that records every call and fails on purpose:
// what runs once, what a failed refit leaves behind and what the next sync does, release after
// refit, and the checks the driver makes of the group's answers.
#include "refit/synchronizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <string>
#include <vector>

#include "core/error_of.h"

namespace refit {
namespace {

using ::testing::ElementsAre;
using testing::error_of;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

class FakeGroup : public WorkerGroup {
 public:
  int sources = 2, destinations = 2;
  std::vector<std::string> calls;
  std::vector<std::pair<uint64_t, SessionId>> created;  // every create_engines() call
  std::vector<uint64_t> memory = {16 * kGiB, 8 * kGiB, 16 * kGiB, 16 * kGiB};
  std::string fail_at;            // the call that throws (once), e.g. "refit", "finalize"
  int extra_metadata = 0;         // prepare() returns this many more (or fewer) entries
  int failed_destination = -1;    // refit(): this destination reports failure without throwing
  double group_seconds = 0;       // refit(): the seconds the group reports (0: none)
  std::vector<uint64_t> indexes;  // refit() indexes

  int train_world_size() const override { return sources; }
  int rollout_world_size() const override { return destinations; }
  std::vector<uint64_t> total_memory_bytes() override {
    step("total_memory_bytes");
    return memory;
  }
  void create_engines(uint64_t bucket_bytes, const SessionId& session) override {
    step("create_engines");
    created.emplace_back(bucket_bytes, session);
  }
  std::vector<Metadata> prepare() override {
    step("prepare");
    return std::vector<Metadata>(sources + destinations + extra_metadata, Metadata{1, 2, 3});
  }
  void init_process_groups(std::span<const Metadata> metadata) override {
    step("init_process_groups");
    EXPECT_EQ(metadata.size(), static_cast<size_t>(sources + destinations));
  }
  RefitReport refit(uint64_t index) override {
    indexes.push_back(index);
    step("refit");
    RefitReport report;
    report.index = 1000;  // the synchronizer numbers refits itself
    report.seconds = group_seconds;
    for (int i = 0; i < sources + destinations; ++i) {
      WorkerRefitReport w;
      w.is_source = i < sources;
      w.rank = w.is_source ? i : i - sources;
      w.failed = !w.is_source && w.rank == failed_destination;
      report.workers.push_back(w);
    }
    return report;
  }
  void finalize() override { step("finalize"); }

 private:
  void step(const std::string& name) {
    calls.push_back(name);
    if (name == fail_at) {
      fail_at.clear();
      throw Error(ErrorKind::kPeerLost, "destination rank 1 (pid 42) was killed by signal 9 during phase " + name);
    }
  }
};

RefitConfig bucket_config(bool release_after_refit = false) {
  RefitConfig config;
  config.bucket_bytes = 4 * kMiB;
  config.release_after_refit = release_after_refit;
  return config;
}

// Captures refit's log lines for one test.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(256)) {
    previous_ = spdlog::default_logger();
    auto logger = std::make_shared<spdlog::logger>("capture", sink_);
    logger->set_level(spdlog::level::info);
    spdlog::set_default_logger(logger);
  }
  ~LogCapture() { spdlog::set_default_logger(previous_); }
  int count(const std::string& text) const {
    int n = 0;
    for (const auto& line : sink_->last_formatted())
      if (line.find(text) != std::string::npos) ++n;
    return n;
  }

 private:
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink_;
  std::shared_ptr<spdlog::logger> previous_;
};

TEST(WeightSynchronizer, PreparesOnceThenOnlyRefits) {
  LogCapture log;
  FakeGroup group;
  RefitConfig config;
  config.update_weights_bucket_memory_ratio = 0.05;
  WeightSynchronizer sync(config, group);
  EXPECT_TRUE(sync.stale());
  EXPECT_FALSE(sync.ready());
  for (uint64_t k = 0; k < 3; ++k) {
    RefitReport report = sync.sync_weights();
    EXPECT_EQ(report.index, k);
    EXPECT_GT(report.seconds, 0);  // the driver's own timing when the group reports none
    EXPECT_GT(report.start_time, 0);
    EXPECT_FALSE(sync.stale());
    EXPECT_TRUE(sync.ready());
  }
  EXPECT_THAT(group.calls, ElementsAre("total_memory_bytes", "create_engines", "prepare", "init_process_groups",
                                       "refit", "refit", "refit"));
  EXPECT_THAT(group.indexes, ElementsAre(0, 1, 2));
  // 5% of the smallest worker's memory, floored to MiB.
  EXPECT_EQ(sync.bucket_size().bytes, (8 * kGiB / 20) / kMiB * kMiB);
  EXPECT_EQ(group.created.at(0).first, sync.bucket_size().bytes);
  EXPECT_EQ(log.count("Using checkpoint-engine refit backend: nixl"), 1);
  EXPECT_EQ(log.count("[checkpoint engine] Bucket size"), 1);
}

TEST(WeightSynchronizer, ShutdownFinalizesAndTheNextSyncPreparesAgain) {
  FakeGroup group;
  WeightSynchronizer sync(bucket_config(), group);
  sync.shutdown();  // not ready: nothing to finalize
  EXPECT_TRUE(group.calls.empty());
  sync.sync_weights();
  sync.shutdown();
  EXPECT_FALSE(sync.ready());
  EXPECT_FALSE(sync.stale());  // the weights of the last refit are still in place
  sync.sync_weights();
  EXPECT_THAT(group.calls, ElementsAre("total_memory_bytes", "create_engines", "prepare", "init_process_groups",
                                       "refit", "finalize", "prepare", "init_process_groups", "refit"));
}

TEST(WeightSynchronizer, AFailedRefitIsStaleShutsDownAndTheNextSyncCreatesEnginesAgain) {
  LogCapture log;
  FakeGroup group;
  WeightSynchronizer sync(bucket_config(), group);
  sync.sync_weights();
  group.fail_at = "refit";
  const std::string message = error_of(ErrorKind::kPeerLost, [&] { sync.sync_weights(); });
  EXPECT_THAT(message, HasSubstr("destination rank 1"));  // the group's own error, unchanged
  EXPECT_TRUE(sync.stale());
  EXPECT_FALSE(sync.ready());
  // Shut down at once (without release_after_refit); then engines again, same session and size.
  sync.sync_weights();
  EXPECT_FALSE(sync.stale());
  EXPECT_THAT(group.calls,
              ElementsAre("total_memory_bytes", "create_engines", "prepare", "init_process_groups", "refit", "refit",
                          "finalize", "create_engines", "prepare", "init_process_groups", "refit"));
  ASSERT_EQ(group.created.size(), 2u);
  EXPECT_EQ(group.created[0], group.created[1]);
  EXPECT_EQ(group.created[0].first, 4 * kMiB);
  EXPECT_THAT(group.indexes, ElementsAre(0, 1, 2));
  // Without another failure nothing is created again; the log lines came once.
  sync.sync_weights();
  EXPECT_EQ(group.calls.back(), "refit");
  EXPECT_EQ(group.created.size(), 2u);
  EXPECT_EQ(log.count("Using checkpoint-engine refit backend"), 1);
  EXPECT_EQ(log.count("Bucket size"), 1);
}

TEST(WeightSynchronizer, AFailedShutdownAfterAFailedRefitLeavesTheRefitsError) {
  LogCapture log;
  struct TwoFailures : FakeGroup {
    bool refit_fails = false;
    RefitReport refit(uint64_t index) override {
      if (refit_fails) {
        calls.push_back("refit");
        fail_at = "finalize";
        throw Error(ErrorKind::kTimeout, "source rank 0 timed out in phase refit");
      }
      return FakeGroup::refit(index);
    }
  } group;
  WeightSynchronizer sync(bucket_config(), group);
  sync.sync_weights();
  group.refit_fails = true;
  const std::string message = error_of(ErrorKind::kTimeout, [&] { sync.sync_weights(); });
  EXPECT_THAT(message, HasSubstr("source rank 0 timed out"));
  EXPECT_EQ(group.calls.back(), "finalize");
  EXPECT_FALSE(sync.ready());
  EXPECT_EQ(log.count("shutdown after a failed refit failed: destination rank 1"), 1);
  group.refit_fails = false;
  sync.sync_weights();
  EXPECT_FALSE(sync.stale());
}

TEST(WeightSynchronizer, ReleaseAfterRefitFinalizesAfterEveryRefit) {
  FakeGroup group;
  WeightSynchronizer sync(bucket_config(/*release_after_refit=*/true), group);
  for (int k = 0; k < 2; ++k) {
    sync.sync_weights();
    EXPECT_FALSE(sync.ready());
    EXPECT_FALSE(sync.stale());
  }
  EXPECT_THAT(group.calls, ElementsAre("total_memory_bytes", "create_engines", "prepare", "init_process_groups",
                                       "refit", "finalize", "prepare", "init_process_groups", "refit", "finalize"));
}

TEST(WeightSynchronizer, AFailedReleaseAfterRefitIsOnlyLogged) {
  LogCapture log;
  FakeGroup group;
  WeightSynchronizer sync(bucket_config(/*release_after_refit=*/true), group);
  group.fail_at = "finalize";
  RefitReport report = sync.sync_weights();  // the refit itself succeeded
  EXPECT_EQ(report.index, 0u);
  EXPECT_FALSE(sync.stale());
  EXPECT_FALSE(sync.ready());
  EXPECT_EQ(log.count("release after refit failed"), 1);
}

TEST(WeightSynchronizer, ReleaseAfterRefitAlsoAfterAFailure) {
  FakeGroup group;
  WeightSynchronizer sync(bucket_config(/*release_after_refit=*/true), group);
  group.fail_at = "refit";
  error_of(ErrorKind::kPeerLost, [&] { sync.sync_weights(); });
  EXPECT_THAT(group.calls, ElementsAre("total_memory_bytes", "create_engines", "prepare", "init_process_groups",
                                       "refit", "finalize"));
}

TEST(WeightSynchronizer, ADestinationReportingFailureFailsTheRefit) {
  FakeGroup group;
  group.failed_destination = 1;
  WeightSynchronizer sync(bucket_config(), group);
  const std::string message = error_of(ErrorKind::kTransport, [&] { sync.sync_weights(); });
  EXPECT_THAT(message, HasSubstr("Weight transfer failed during nixl checkpoint-engine sync"));
  EXPECT_THAT(message, HasSubstr("destination rank 1"));
  EXPECT_TRUE(sync.stale());
  EXPECT_FALSE(sync.ready());
  EXPECT_EQ(group.calls.back(), "finalize");
  group.failed_destination = -1;
  sync.sync_weights();
  EXPECT_FALSE(sync.stale());
  EXPECT_EQ(group.created.size(), 2u);

  FakeGroup other;
  other.failed_destination = 0;
  WeightSynchronizer plugin(bucket_config(), other, "my_module:MyEngine");
  EXPECT_THAT(error_of(ErrorKind::kTransport, [&] { plugin.sync_weights(); }),
              HasSubstr("during my_module:MyEngine checkpoint-engine sync"));
}

TEST(WeightSynchronizer, MetadataThatDoNotNumberTheWorkersAreATopologyError) {
  for (int extra : {-1, 1}) {
    FakeGroup group;
    group.extra_metadata = extra;
    WeightSynchronizer sync(bucket_config(), group);
    const std::string message = error_of(ErrorKind::kTopology, [&] { sync.sync_weights(); });
    EXPECT_THAT(message, HasSubstr(fmt::format("returned {} metadata entries for train_world_size=2 + "
                                               "rollout_world_size=2",
                                               4 + extra)));
    EXPECT_TRUE(sync.stale());
    EXPECT_FALSE(sync.ready());
    EXPECT_THAT(group.calls, ElementsAre("total_memory_bytes", "create_engines", "prepare"));
  }
}

TEST(WeightSynchronizer, TheGroupsSecondsAreUsedWhenItReportsThem) {
  FakeGroup group;
  group.group_seconds = 12.5;
  WeightSynchronizer sync(bucket_config(), group);
  EXPECT_EQ(sync.sync_weights().seconds, 12.5);
}

TEST(WeightSynchronizer, BucketSizingErrorsComeBeforeAnyEngine) {
  FakeGroup group;
  group.memory = {10 * kMiB, 16 * kGiB, 16 * kGiB, 16 * kGiB};
  RefitConfig config;
  config.update_weights_bucket_memory_ratio = 0.05;
  WeightSynchronizer sync(config, group);
  EXPECT_THAT(error_of(ErrorKind::kConfig, [&] { sync.sync_weights(); }),
              HasSubstr("Checkpoint-engine bucket sizing produced less than 1 MiB per buffer"));
  EXPECT_THAT(group.calls, ElementsAre("total_memory_bytes"));
  EXPECT_TRUE(sync.stale());
}

TEST(WeightSynchronizer, AFailureBeforeTheRefitCreatesEnginesAgainWithTheSameSession) {
  FakeGroup group;
  WeightSynchronizer sync(bucket_config(), group);
  group.fail_at = "init_process_groups";
  error_of(ErrorKind::kPeerLost, [&] { sync.sync_weights(); });
  EXPECT_FALSE(sync.ready());
  sync.sync_weights();
  EXPECT_THAT(group.calls, ElementsAre("total_memory_bytes", "create_engines", "prepare", "init_process_groups",
                                       "create_engines", "prepare", "init_process_groups", "refit"));
  ASSERT_EQ(group.created.size(), 2u);
  EXPECT_EQ(group.created[0].second, group.created[1].second);
}

}  // namespace
}  // namespace refit
