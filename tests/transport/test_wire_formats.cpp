// The transports' own wire formats, through the decoders the fuzz targets run (fuzz/): the local
// control socket's frames, local peer addresses, CUDA IPC region keys, NCCL messages and refit's
// UCX address. Each round-trips, is little-endian on the wire (explicit bytes), and turns every
// truncation and malformed field into Error(kProtocol) naming what was decoded. No GPU needed:
// these files compile without CUDA, NCCL or UCX.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error_of.h"
#include "transport/cuda_ipc/cuda_ipc_key.h"
#include "transport/local_socket/control_frame.h"
#include "transport/local_socket/local_peer.h"
#include "transport/nccl/nccl_wire.h"
#include "transport/ucx/ucx_address.h"

namespace refit {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using testing::error_of;
using ::testing::HasSubstr;

EndpointId id_from(uint8_t first) {
  EndpointId id;
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(first + i);
  return id;
}

Bytes cut(const Bytes& bytes, size_t keep) { return Bytes(bytes.begin(), bytes.begin() + static_cast<long>(keep)); }

// Every proper prefix of `bytes` is refused by `decode` with kProtocol and a message holding `what`.
template <typename Decode>
void expect_truncations_refused(const Bytes& bytes, const std::string& what, Decode decode) {
  for (size_t keep = 0; keep < bytes.size(); ++keep) {
    const Bytes part = cut(bytes, keep);
    EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { decode(part); }), HasSubstr(what)) << keep << " bytes";
  }
  Bytes longer = bytes;
  longer.push_back(0);
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { decode(longer); }), AllOf(HasSubstr(what), HasSubstr("trailing")));
}

// ---- the local control socket's frames ----

TEST(ControlFrame, HeadersAreLittleEndian) {
  EXPECT_THAT(control_frame::encode_header(control_frame::FrameType::kData, 5, 0x010203),
              ElementsAre(0x05, 0x02, 0x01, 0x00, 2, 5));
  const Bytes hello = control_frame::encode_hello(id_from(1), id_from(100));
  ASSERT_EQ(hello.size(), 6u + 4 + 1 + 32);
  EXPECT_THAT(cut(hello, 11), ElementsAre(39, 0, 0, 0, 1, 0, 'R', 'F', 'L', 'S', 1));
}

TEST(ControlFrame, DecodesAStreamFrameByFrame) {
  Bytes stream = control_frame::encode_hello(id_from(1), id_from(100));
  const size_t hello_bytes = stream.size();
  const Bytes header = control_frame::encode_header(control_frame::FrameType::kData, 7, 3);
  stream.insert(stream.end(), header.begin(), header.end());
  stream.insert(stream.end(), {9, 8, 7});

  auto first = control_frame::decode_frame(stream, "a new connection");
  ASSERT_TRUE(first.complete);
  EXPECT_EQ(first.bytes, hello_bytes);
  const auto hello = control_frame::decode_hello(first, "a new connection");
  EXPECT_EQ(hello.sender, id_from(1));
  EXPECT_EQ(hello.target, id_from(100));

  const std::span<const uint8_t> rest = std::span<const uint8_t>(stream).subspan(first.bytes);
  auto partial = control_frame::decode_frame(rest.first(7), "endpoint 01");
  EXPECT_FALSE(partial.complete);
  EXPECT_EQ(partial.bytes, 9u);  // known as soon as the length has arrived
  EXPECT_EQ(control_frame::decode_frame(rest.first(3), "endpoint 01").bytes, 0u);
  auto data = control_frame::decode_frame(rest, "endpoint 01");
  ASSERT_TRUE(data.complete);
  EXPECT_EQ(data.type, control_frame::FrameType::kData);
  EXPECT_EQ(data.channel, 7);
  EXPECT_THAT(data.payload, ElementsAre(9, 8, 7));
}

TEST(ControlFrame, MalformedFramesAreProtocolErrorsNamingTheSender) {
  auto decode = [](const Bytes& bytes) { return control_frame::decode_frame(bytes, "endpoint 0a0b"); };
  EXPECT_THAT(error_of(ErrorKind::kProtocol,
                       [&] {
                         decode({1, 0, 0, 0, 2});
                       }),
              AllOf(HasSubstr("malformed control frame from endpoint 0a0b"), HasSubstr("'length' is 1")));
  EXPECT_THAT(error_of(ErrorKind::kProtocol,
                       [&] {
                         decode({0xff, 0xff, 0xff, 0xff});
                       }),
              AllOf(HasSubstr("endpoint 0a0b"), HasSubstr("4294967295")));
  EXPECT_THAT(error_of(ErrorKind::kProtocol,
                       [&] {
                         decode({2, 0, 0, 0, 9, 0});
                       }),
              AllOf(HasSubstr("endpoint 0a0b"), HasSubstr("'type' is 9")));

  const Bytes hello = control_frame::encode_hello(id_from(1), id_from(100));
  auto hello_of = [](const Bytes& frame) {
    return control_frame::decode_hello(control_frame::decode_frame(frame, "a new connection"), "a new connection");
  };
  Bytes bad_magic = hello;
  bad_magic[7] ^= 0xff;
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { hello_of(bad_magic); }),
              AllOf(HasSubstr("HELLO from a new connection"), HasSubstr("magic 'RFLS'")));
  Bytes other_version = hello;
  other_version[10] = 2;
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { hello_of(other_version); }),
              AllOf(HasSubstr("HELLO from a new connection"), HasSubstr("'version' is 2")));
  // Found by fuzz_local_frame (fuzz/corpus/local_frame/crash-hello-on-channel-61): a HELLO on
  // another channel than 0 was accepted, though no encoder writes one.
  Bytes other_channel = hello;
  other_channel[5] = 61;
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { hello_of(other_channel); }),
              AllOf(HasSubstr("HELLO from a new connection"), HasSubstr("'channel' is 61")));
  Bytes data_first = control_frame::encode_header(control_frame::FrameType::kData, 0, 1);
  data_first.push_back(0);
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { hello_of(data_first); }),
              AllOf(HasSubstr("HELLO from a new connection"), HasSubstr("did not start with a refit HELLO")));
  // A HELLO one byte short or long (its length says so): the payload is checked field by field.
  for (bool shorter : {true, false}) {
    Bytes payload(hello.begin() + 6, hello.end());
    if (shorter) {
      payload.pop_back();
    } else {
      payload.push_back(0);
    }
    Bytes frame = control_frame::encode_header(control_frame::FrameType::kHello, 0, payload.size());
    frame.insert(frame.end(), payload.begin(), payload.end());
    EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { hello_of(frame); }), HasSubstr("HELLO from a new connection"));
  }
}

// ---- local peer addresses (CUDA IPC, NCCL) ----

TEST(LocalPeerAddressWire, IsLittleEndianAndEveryTruncationIsRefusedNamingThePeer) {
  LocalPeerAddress address;
  address.endpoint = id_from(1);
  address.identity.process = id_from(50);
  address.identity.pid = 0x01020304;
  address.identity.host = "boot/host";
  address.device = -2;
  address.bus_id = "0000:19:00.0";
  const Bytes blob = encode_local_peer_address(kNcclAddressMagic, address);
  // magic, version, endpoint, process, then the pid little-endian and the host behind a u32 length.
  EXPECT_THAT(cut(blob, 5), ElementsAre('R', 'F', 'N', 'C', 1));
  EXPECT_THAT(Bytes(blob.begin() + 37, blob.begin() + 45), ElementsAre(4, 3, 2, 1, 9, 0, 0, 0));
  EXPECT_THAT(Bytes(blob.begin() + 54, blob.begin() + 58), ElementsAre(0xfe, 0xff, 0xff, 0xff));
  const LocalPeerAddress back = decode_local_peer_address(kNcclAddressMagic, "NCCL", blob, "source rank 2");
  EXPECT_EQ(back.identity.pid, 0x01020304u);
  EXPECT_EQ(back.device, -2);
  EXPECT_EQ(back.bus_id, "0000:19:00.0");
  expect_truncations_refused(blob, "NCCL address of source rank 2", [](const Bytes& b) {
    decode_local_peer_address(kNcclAddressMagic, "NCCL", b, "source rank 2");
  });
  Bytes long_host = blob;
  long_host[44] = 0x7f;  // the host's length, high byte: 2 GiB announced
  EXPECT_THAT(error_of(ErrorKind::kProtocol,
                       [&] { decode_local_peer_address(kNcclAddressMagic, "NCCL", long_host, "source rank 2"); }),
              AllOf(HasSubstr("NCCL address of source rank 2"), HasSubstr("field 'host'")));
}

// ---- CUDA IPC region keys ----

CudaIpcRegionKey sample_ipc_key() {
  CudaIpcRegionKey key;
  key.exported = true;
  for (size_t i = 0; i < key.handle.size(); ++i) key.handle[i] = static_cast<uint8_t>(i * 3);
  key.offset = 0x0102030405060708;
  key.owner = id_from(20);
  key.process = id_from(40);
  key.device = 1;
  return key;
}

TEST(CudaIpcKey, RoundTripsLittleEndian) {
  const CudaIpcRegionKey key = sample_ipc_key();
  const Bytes bytes = encode_cuda_ipc_key(key);
  ASSERT_EQ(bytes.size(), 4u + 1 + 1 + 64 + 8 + 16 + 16 + 4);
  EXPECT_THAT(cut(bytes, 6), ElementsAre('R', 'C', 'I', 'K', 1, 1));
  EXPECT_THAT(Bytes(bytes.begin() + 70, bytes.begin() + 78), ElementsAre(8, 7, 6, 5, 4, 3, 2, 1));
  EXPECT_THAT(Bytes(bytes.end() - 4, bytes.end()), ElementsAre(1, 0, 0, 0));
  const CudaIpcRegionKey back = decode_cuda_ipc_key(bytes, "source rank 1");
  EXPECT_TRUE(back.exported);
  EXPECT_EQ(back.handle, key.handle);
  EXPECT_EQ(back.offset, key.offset);
  EXPECT_EQ(back.owner, key.owner);
  EXPECT_EQ(back.process, key.process);
  EXPECT_EQ(back.device, 1);
}

TEST(CudaIpcKey, MalformedKeysAreProtocolErrorsNamingThePeer) {
  const Bytes bytes = encode_cuda_ipc_key(sample_ipc_key());
  expect_truncations_refused(bytes, "CUDA IPC region key of source rank 1",
                             [](const Bytes& b) { decode_cuda_ipc_key(b, "source rank 1"); });
  Bytes flag = bytes;
  flag[5] = 2;
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { decode_cuda_ipc_key(flag, "source rank 1"); }),
              AllOf(HasSubstr("CUDA IPC region key of source rank 1"), HasSubstr("'exported' is 2")));
  Bytes version = bytes;
  version[4] = 9;
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { decode_cuda_ipc_key(version, "source rank 1"); }),
              AllOf(HasSubstr("CUDA IPC region key of source rank 1"), HasSubstr("version 9")));
  // A NCCL key is not a CUDA IPC key.
  EXPECT_THAT(error_of(ErrorKind::kProtocol,
                       [&] {
                         decode_cuda_ipc_key(encode_nccl_key({id_from(1), 3}), "source rank 1");
                       }),
              HasSubstr("magic 'RCIK'"));
}

// ---- NCCL messages ----

TEST(NcclWire, RequestsKeysSetupsAndRepliesRoundTripLittleEndian) {
  const Bytes request = encode_nccl_request({1, 2, 0x0300, 0x04000000});
  EXPECT_THAT(request, ElementsAre(1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4,
                                   0, 0, 0, 0));
  const NcclReadRequest r = decode_nccl_request(request, "endpoint 01");
  EXPECT_EQ(r.id, 1u);
  EXPECT_EQ(r.region, 2u);
  EXPECT_EQ(r.offset, 0x300u);
  EXPECT_EQ(r.length, 0x4000000u);

  const NcclRegionKey key = decode_nccl_key(encode_nccl_key({id_from(7), 0x0102}), "source rank 0");
  EXPECT_EQ(key.owner, id_from(7));
  EXPECT_EQ(key.region, 0x0102u);

  NcclSetup setup;
  setup.generation = 5;
  for (size_t i = 0; i < setup.id.size(); ++i) setup.id[i] = static_cast<uint8_t>(i);
  const NcclSetup setup_back = decode_nccl_setup(encode_nccl_setup(setup), "source rank 0");
  EXPECT_EQ(setup_back.generation, 5u);
  EXPECT_EQ(setup_back.id, setup.id);

  const Bytes reply = encode_nccl_reply({9, "no"});
  EXPECT_THAT(reply, ElementsAre(9, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 'n', 'o'));
  const NcclReply reply_back = decode_nccl_reply(reply, "source rank 0");
  EXPECT_EQ(reply_back.request, 9u);
  EXPECT_EQ(reply_back.error, "no");
}

TEST(NcclWire, MalformedMessagesAreProtocolErrorsNamingThePeer) {
  expect_truncations_refused(encode_nccl_request({1, 2, 3, 4}), "NCCL read request from endpoint 0a",
                             [](const Bytes& b) { decode_nccl_request(b, "endpoint 0a"); });
  expect_truncations_refused(encode_nccl_key({id_from(1), 2}), "NCCL region key of source rank 4",
                             [](const Bytes& b) { decode_nccl_key(b, "source rank 4"); });
  expect_truncations_refused(encode_nccl_setup({}), "NCCL setup message of source rank 4",
                             [](const Bytes& b) { decode_nccl_setup(b, "source rank 4"); });
  expect_truncations_refused(encode_nccl_reply({3, "refused"}), "NCCL reply from source rank 4",
                             [](const Bytes& b) { decode_nccl_reply(b, "source rank 4"); });
  Bytes version = encode_nccl_key({id_from(1), 2});
  version[4] = 0;
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { decode_nccl_key(version, "source rank 4"); }),
              AllOf(HasSubstr("NCCL region key of source rank 4"), HasSubstr("version 0")));
}

// ---- refit's UCX address ----

TEST(UcxAddressWire, IsLittleEndianAndRoundTrips) {
  InstanceId id;
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(0x40 + i);
  const Bytes worker(0x0102, 0x5a);
  const ProcessIdentity process{"boot", 7, "host-a", 4242, 99};
  const Bytes blob = encode_ucx_address(id, process, false, worker);
  EXPECT_THAT(cut(blob, 4), ElementsAre('R', 'F', 'U', '3'));
  EXPECT_EQ(blob[blob.size() - worker.size() - 5], 0);       // the error handling, before the length
  const size_t length_at = blob.size() - worker.size() - 4;  // the worker address's length, then it
  EXPECT_THAT(Bytes(blob.begin() + length_at, blob.begin() + length_at + 4), ElementsAre(0x02, 0x01, 0, 0));
  const UcxAddress back = decode_ucx_address(blob, "source rank 3");
  EXPECT_EQ(back.id, id);
  EXPECT_EQ(back.process.boot_id, "boot");
  EXPECT_EQ(back.process.namespaces, 7u);
  EXPECT_EQ(back.process.hostname, "host-a");
  EXPECT_EQ(back.process.pid, 4242);
  EXPECT_EQ(back.process.start_time, 99u);
  EXPECT_EQ(back.worker_address, worker);
  EXPECT_FALSE(back.peer_errors);
  EXPECT_TRUE(decode_ucx_address(encode_ucx_address(id, process, true, worker), "source rank 3").peer_errors);
  EXPECT_EQ(decode_ucx_message_header(id), id);
}

TEST(UcxAddressWire, MalformedAddressesAndHeadersAreProtocolErrors) {
  InstanceId id{};
  const Bytes blob = encode_ucx_address(id, ProcessIdentity{"boot", 1, "host", 2, 3}, true, Bytes{1, 2, 3});
  expect_truncations_refused(blob, "UCX address for source rank 3",
                             [](const Bytes& b) { decode_ucx_address(b, "source rank 3"); });
  EXPECT_THAT(error_of(ErrorKind::kProtocol,
                       [&] { decode_ucx_address(encode_ucx_address(id, {}, true, {}), "source rank 3"); }),
              AllOf(HasSubstr("UCX address for source rank 3"), HasSubstr("worker address is empty")));
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { decode_ucx_message_header(Bytes(15)); }),
              HasSubstr("malformed UCX message header"));
  EXPECT_THAT(error_of(ErrorKind::kProtocol, [&] { decode_ucx_message_header(Bytes(17)); }),
              HasSubstr("malformed UCX message header"));
}

}  // namespace
}  // namespace refit
