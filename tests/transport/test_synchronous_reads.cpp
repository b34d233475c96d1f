// Posted reads on a backend whose reads complete at once (the in-process transport, as CUDA IPC
// and NCCL): the same contract as UCX's asynchronous reads.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/error_of.h"
#include "transport/inproc/inproc_transport.h"

namespace refit {
namespace {

using testing::error_kind_of;

TEST(SynchronousReads, KeepTheAsynchronousContract) {
  auto fabric = make_inproc_fabric();
  auto owner = create_inproc_transport(fabric), reader = create_inproc_transport(fabric);
  EXPECT_FALSE(reader->capabilities().async_reads);
  std::vector<std::byte> remote_bytes(64), local_bytes(64);
  for (size_t i = 0; i < remote_bytes.size(); ++i) remote_bytes[i] = std::byte(i);
  const RemoteRegion remote = owner->describe(owner->register_memory(remote_bytes.data(), remote_bytes.size()));
  const RegionId local = reader->register_memory(local_bytes.data(), local_bytes.size());
  const PeerId peer = reader->connect(owner->address(), "owner");
  const auto deadline = deadline_after(std::chrono::seconds(5));

  const ReadId a = reader->post_read(peer, remote, 0, local_bytes.data(), local, 32, deadline);
  const ReadId b = reader->post_read(peer, remote, 32, local_bytes.data() + 32, local, 32, deadline);
  EXPECT_TRUE(reader->test_read(a));
  reader->wait_read(b, deadline);
  EXPECT_EQ(local_bytes, remote_bytes);
  // Each read ends once: its id is then unknown.
  EXPECT_EQ(error_kind_of([&] { reader->test_read(a); }), ErrorKind::kInvalidArgument);
  // A read that fails reports its error where an asynchronous one would: at test or wait.
  const ReadId bad = reader->post_read(peer, remote, 60, local_bytes.data(), local, 8, deadline);
  EXPECT_EQ(error_kind_of([&] { reader->wait_read(bad, deadline); }), ErrorKind::kTransport);
  reader->cancel_read(reader->post_read(peer, remote, 0, local_bytes.data(), local, 8, deadline));
}

}  // namespace
}  // namespace refit
