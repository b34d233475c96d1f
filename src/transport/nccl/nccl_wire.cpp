#include "transport/nccl/nccl_wire.h"

#include "core/fail.h"
#include "core/wire.h"

namespace refit {
namespace {

constexpr std::string_view kKeyMagic = "RNCK";
constexpr uint8_t kKeyVersion = 1;

}  // namespace

Bytes encode_nccl_key(const NcclRegionKey& key) {
  ByteWriter w;
  w.put_raw(kKeyMagic);
  w.put<uint8_t>(kKeyVersion);
  w.put_raw(key.owner);
  w.put<uint64_t>(key.region);
  return w.take();
}

NcclRegionKey decode_nccl_key(std::span<const uint8_t> bytes, const std::string& label) {
  ByteReader r(bytes, "NCCL region key of " + label);
  r.expect_magic(kKeyMagic);
  if (uint8_t version = r.get<uint8_t>("version"); version != kKeyVersion)
    fail(ErrorKind::kProtocol, "NCCL region key of {} has version {}, this build speaks {}", label, version,
         kKeyVersion);
  NcclRegionKey key;
  r.get_raw(key.owner, "owner");
  key.region = r.get<uint64_t>("region");
  r.expect_end();
  return key;
}

Bytes encode_nccl_setup(const NcclSetup& setup) {
  ByteWriter w;
  w.put<uint64_t>(setup.generation);
  w.put_raw(setup.id);
  return w.take();
}

NcclSetup decode_nccl_setup(std::span<const uint8_t> bytes, const std::string& label) {
  ByteReader r(bytes, "NCCL setup message of " + label);
  NcclSetup setup;
  setup.generation = r.get<uint64_t>("generation");
  r.get_raw(setup.id, "unique id");
  r.expect_end();
  return setup;
}

Bytes encode_nccl_request(const NcclReadRequest& request) {
  ByteWriter w;
  w.put<uint64_t>(request.id);
  w.put<uint64_t>(request.region);
  w.put<uint64_t>(request.offset);
  w.put<uint64_t>(request.length);
  return w.take();
}

NcclReadRequest decode_nccl_request(std::span<const uint8_t> bytes, const std::string& from) {
  ByteReader r(bytes, "NCCL read request from " + from);
  NcclReadRequest request;
  request.id = r.get<uint64_t>("request id");
  request.region = r.get<uint64_t>("region");
  request.offset = r.get<uint64_t>("offset");
  request.length = r.get<uint64_t>("length");
  r.expect_end();
  return request;
}

Bytes encode_nccl_reply(const NcclReply& reply) {
  ByteWriter w;
  w.put<uint64_t>(reply.request);
  w.put_string<uint32_t>(reply.error);
  return w.take();
}

NcclReply decode_nccl_reply(std::span<const uint8_t> bytes, const std::string& from) {
  ByteReader r(bytes, "NCCL reply from " + from);
  NcclReply reply;
  reply.request = r.get<uint64_t>("request id");
  reply.error = r.get_string<uint32_t>("error");
  r.expect_end();
  return reply;
}

}  // namespace refit
