// Writes the seed corpus: small valid inputs for every fuzz target, made with refit's own
// encoders and bucket packer, plus edge cases (empty, truncated, bad magic, odd sizes).
// Deterministic: running it again rewrites the same files.
// Usage: fuzz_seed_corpus DIR     (writes DIR/<target>/NAME for every target of fuzz/CMakeLists.txt)
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/wire.h"
#include "delta/codec.h"
#include "engine/protocol.h"
#include "refit/layout.h"
#include "refit/plan.h"
#include "refit/safetensors.h"
#include "sync/channel_frame.h"
#include "transport/cuda_ipc/cuda_ipc_key.h"
#include "transport/local_socket/control_frame.h"
#include "transport/local_socket/local_peer.h"
#include "transport/nccl/nccl_wire.h"
#include "transport/ucx/ucx_address.h"

using namespace refit;
namespace fs = std::filesystem;

namespace {

fs::path g_root;
int g_files = 0;

void write(const std::string& target, const std::string& name, const Bytes& bytes) {
  fs::create_directories(g_root / target);
  std::ofstream out(g_root / target / name, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ++g_files;
}

Bytes truncated(Bytes b, size_t keep) {
  b.resize(std::min(keep, b.size()));
  return b;
}

Bytes flipped(Bytes b, size_t at) {
  if (at < b.size()) b[at] ^= 0xff;
  return b;
}

// --- metadata ----------------------------------------------------------------------------------

Layout sample_layout() {
  Layout l;
  l.tensors["model.embed_tokens.weight"] = Request::narrow(0, 0, 64);
  l.tensors["model.layers.0.self_attn.q_proj.weight"] = Request::narrow(0, 32, 32);
  l.tensors["model.layers.0.mlp.experts.1.down_proj.weight"] = Request::drop();
  l.tensors["lm_head.weight"] = Request::whole();
  l.drop_prefixes = {"model.layers.1.", "model.layers.2."};
  return l;
}

protocol::EngineMetadata sample_metadata(uint64_t bucket_bytes, bool with_layout) {
  protocol::EngineMetadata m;
  for (size_t i = 0; i < m.session.size(); ++i) m.session[i] = static_cast<uint8_t>(0xa0 + i);
  m.model_fingerprint = 0x1234567890abcdefull;
  m.bucket_bytes = bucket_bytes;
  m.transport_name = "UCX";
  for (int i = 0; i < 24; ++i) m.transport_address.push_back(static_cast<uint8_t>(i * 37));
  m.buffers.address = 0x7f0000000000ull;
  m.buffers.length = 2 * bucket_bytes;
  m.buffers.key = {1, 2, 3, 4, 5};
  if (with_layout) m.layout = encode_layout(sample_layout());
  m.process.boot_id = "6d3b6a0e-8f1c-4b8e-9d7a-2f6c1e0b9a54";
  m.process.pid = 4242;
  m.process.start_time = 987654321;
  return m;
}

void metadata_seeds() {
  write("metadata", "source", protocol::encode(sample_metadata(4096, false)));
  write("metadata", "destination_with_layout", protocol::encode(sample_metadata(1 << 20, true)));
  auto empty = sample_metadata(0, false);
  empty.transport_name.clear();
  empty.transport_address.clear();
  empty.buffers.key.clear();
  write("metadata", "empty_fields", protocol::encode(empty));
  auto bad_layout = sample_metadata(64, false);
  bad_layout.layout = {0x52, 0x46, 0x4c, 0x59, 1, 0, 3};  // layout magic, then a bad fallback
  write("metadata", "bad_layout", protocol::encode(bad_layout));
  auto small_buffer = sample_metadata(4096, false);
  small_buffer.buffers.length = 4096 + 100;
  write("metadata", "buffer_smaller_than_bucket", protocol::encode(small_buffer));
  auto old = sample_metadata(4096, false);
  old.version = 1;
  write("metadata", "old_version", protocol::encode(old));
  write("metadata", "truncated", truncated(protocol::encode(sample_metadata(4096, true)), 40));
  write("metadata", "bad_magic", flipped(protocol::encode(sample_metadata(4096, false)), 0));
  write("metadata", "empty", {});
}

// --- layouts -----------------------------------------------------------------------------------

void layout_seeds() {
  write("layout", "sample", encode_layout(sample_layout()));
  write("layout", "empty", encode_layout(Layout{}));
  Layout drop_all;
  drop_all.fallback = Take::kDrop;
  drop_all.tensors["model.norm.weight"] = Request::whole();
  write("layout", "fallback_drop", encode_layout(drop_all));
  Layout wide;
  wide.tensors["w"] = Request::narrow(63, INT64_MAX - 1, 1);
  write("layout", "extreme_slice", encode_layout(wide));
  write("layout", "truncated", truncated(encode_layout(sample_layout()), 30));
  write("layout", "bad_magic", flipped(encode_layout(sample_layout()), 1));
}

// --- messages ----------------------------------------------------------------------------------

protocol::Abort abort_message(uint64_t refit, std::string reason) {
  protocol::Abort a;
  a.refit = refit;
  a.reason = std::move(reason);
  return a;
}

protocol::BucketDone done_message(uint64_t refit, uint64_t seq) {
  protocol::BucketDone d;
  d.refit = refit;
  d.seq = seq;
  return d;
}

TensorInfo tensor(std::string name, DType dtype, std::vector<int64_t> shape) {
  return {std::move(name), dtype, std::move(shape)};
}

// A small model: whole tensors, one split over buckets, a zero-byte tensor, a scalar.
std::vector<TensorInfo> sample_model() {
  return {
      tensor("model.embed_tokens.weight", DType::kBFloat16, {16, 8}),
      tensor("model.layers.0.input_layernorm.weight", DType::kFloat32, {8}),
      tensor("model.layers.0.mlp.experts.0.gate_proj.weight", DType::kFloat8E4M3FN, {40, 3}),
      tensor("model.layers.0.mlp.empty", DType::kFloat16, {0, 4}),
      tensor("model.layers.0.self_attn.scale", DType::kFloat64, {}),
      tensor("lm_head.weight", DType::kInt32, {5, 7}),
  };
}

// The BucketReady messages a source sends for `model`, as CheckpointEngine::run_send builds them.
std::vector<protocol::BucketReady> buckets_for(const std::vector<TensorInfo>& model, uint64_t bucket_bytes,
                                               uint64_t refit) {
  std::vector<protocol::BucketReady> out;
  BucketPacker packer(bucket_bytes);
  protocol::BucketReady b;
  b.refit = refit;
  protocol::Manifest manifest;
  auto flush = [&](bool last) {
    b.is_last = last;
    b.manifest = std::make_shared<protocol::Manifest>(std::move(manifest));
    out.push_back(b);
    b.seq++;
    b.offset = b.offset == 0 ? bucket_bytes : 0;
    manifest = {};
    b.used_bytes = 0;
  };
  for (const auto& t : model) {
    for (const ChunkPlacement& c : packer.place(t)) {
      if (c.starts_bucket) flush(false);
      manifest.entries.push_back({t, Box::whole(), c.tensor_offset, c.size, c.bucket_offset});
      b.used_bytes = c.bucket_offset + c.size;
    }
  }
  flush(true);
  return out;
}

void message_seeds() {
  auto model = sample_model();
  auto buckets = buckets_for(model, 64, 0);
  for (size_t i = 0; i < buckets.size() && i < 6; ++i)
    write("message", "ready_64_" + std::to_string(i), protocol::encode(buckets[i]));
  auto whole = buckets_for(model, 4096, 3);
  write("message", "ready_4096_all", protocol::encode(whole.front()));
  protocol::BucketReady empty;
  empty.is_last = true;
  write("message", "ready_empty", protocol::encode(empty));
  // Entries sent in place, mapped: a whole tensor in one source region, a chunk in another, and
  // one packed.
  protocol::BucketReady in_place;
  in_place.refit = 5;
  in_place.used_bytes = 16;
  protocol::edit_manifest(in_place).regions = {{{0x7f0000001000, 64, {1, 2, 3}}, MemoryKind::kHost},
                                               {{0x7f0000100000, 48, {}}, MemoryKind::kHost}};
  protocol::edit_manifest(in_place).entries = {{tensor("a", DType::kFloat32, {4, 4}), Box::whole(), 0, 64, 0, 1, 0},
                                               {tensor("b", DType::kUInt8, {40}), Box::whole(), 0, 24, 0, 2, 8},
                                               {tensor("b", DType::kUInt8, {40}), Box::whole(), 24, 16, 0, 0}};
  write("message", "ready_in_place", protocol::encode(in_place));
  // For a link that reads source memory: a tensor read from a source region into the bucket, then
  // one packed in the buffer.
  protocol::BucketReady read;
  read.refit = 5;
  read.used_bytes = 104;
  protocol::edit_manifest(read).regions = {{{0x7f0000001000, 4096, {1, 2, 3}}, MemoryKind::kHost}};
  protocol::edit_manifest(read).entries = {{tensor("a", DType::kFloat32, {4, 4}), Box::whole(), 0, 64, 0, 1, 1024},
                                           {tensor("b", DType::kUInt8, {40}), Box::whole(), 0, 40, 64}};
  write("message", "ready_read", protocol::encode(read));
  protocol::edit_manifest(read).entries[1].bucket_offset = 60;  // overlaps the entry before
  write("message", "read_overlapping", protocol::encode(read));
  protocol::edit_manifest(read).entries[1].bucket_offset = 64;
  protocol::edit_manifest(read).entries[0].source_offset = 4090;  // past its region
  write("message", "read_past_region", protocol::encode(read));
  // A replay: the manifest of bucket 1 of refit 4, not on the wire.
  protocol::BucketReady replay = buckets[1];
  replay.refit = 5;
  replay.replay_of = 4;
  write("message", "ready_replay", protocol::encode(replay));
  write("message", "done", protocol::encode(done_message(2, 17)));
  write("message", "abort", protocol::encode(abort_message(1, "source rank 0 failed in phase pack bucket 3")));
  write("message", "abort_empty", protocol::encode(abort_message(0, "")));
  protocol::Abort farewell = abort_message(7, "it called finalize()");
  farewell.kind = ErrorKind::kPeerLost;
  farewell.farewell = true;
  write("message", "farewell", protocol::encode(farewell));

  // Valid encodings that validate() must refuse.
  protocol::BucketReady bad;
  bad.offset = 64;
  bad.used_bytes = 64;
  protocol::edit_manifest(bad).entries = {{tensor("t", DType::kFloat32, {4}), Box::whole(), 0, 16, 56}};
  write("message", "chunk_past_used_bytes", protocol::encode(bad));
  protocol::edit_manifest(bad).entries[0] = {tensor("t", DType::kFloat32, {4}), Box::whole(), 8, 16, 0};
  write("message", "chunk_past_tensor", protocol::encode(bad));
  protocol::edit_manifest(bad).entries[0] = {tensor("t", DType::kFloat32, {INT64_MAX, 4, 0}), Box::whole(), 0, 0, 0};
  write("message", "overflowing_shape", protocol::encode(bad));
  protocol::edit_manifest(bad).entries[0] = {tensor("t", DType::kUInt8, {1, 1, 1, 1, 1, 1, 1, 1}), Box::whole(), 0, 1,
                                             0};
  write("message", "rank_8", protocol::encode(bad));
  // A piece: rows [1, 3) x columns [2, 4) of a 4 x 4 tensor, and one that does not fit.
  protocol::edit_manifest(bad).entries[0] = {tensor("t", DType::kUInt8, {4, 4}),
                                             Box::of(Request::narrow(0, 1, 2)).narrowed({1, 2, 2}), 0, 4, 0};
  write("message", "piece_2d", protocol::encode(bad));
  protocol::edit_manifest(bad).entries[0].box.cuts[1].start = 3;
  write("message", "piece_past_tensor", protocol::encode(bad));
  protocol::edit_manifest(bad).entries[0] = {tensor("t", DType::kUInt8, {8}), Box::whole(), 0, 8, 0};
  bad.offset = UINT64_MAX - 4;
  write("message", "offset_past_region", protocol::encode(bad));
  bad.offset = 0;
  bad.used_bytes = UINT64_MAX;
  protocol::edit_manifest(bad).entries[0] = {tensor("t", DType::kUInt8, {8}), Box::whole(), 0, 8, UINT64_MAX - 4};
  write("message", "offset_wraps", protocol::encode(bad));
  bad.used_bytes = 8;
  protocol::edit_manifest(bad).regions = {{{0x1000, 4, {}}, MemoryKind::kHost}};
  protocol::edit_manifest(bad).entries[0] = {tensor("t", DType::kUInt8, {8}), Box::whole(), 0, 8, 0, 1, 0};
  write("message", "chunk_past_region", protocol::encode(bad));
  protocol::edit_manifest(bad).entries[0].region = 2;
  write("message", "region_out_of_range", protocol::encode(bad));
  protocol::edit_manifest(bad).regions.clear();

  write("message", "truncated", truncated(protocol::encode(buckets[0]), 50));
  write("message", "bad_magic", flipped(protocol::encode(buckets[0]), 0));
  write("message", "empty", {});
}

// --- assembler streams -------------------------------------------------------------------------

// Must match kBucketSizes in fuzz_assembler.cpp: byte 0 of an input is an index into it.
constexpr uint64_t kAssemblerBucketSizes[] = {1, 2, 8, 64, 256, 4096, 65536};

void put_frame(Bytes& stream, const Bytes& message) {
  stream.push_back(static_cast<uint8_t>(message.size() & 0xff));
  stream.push_back(static_cast<uint8_t>(message.size() >> 8));
  stream.insert(stream.end(), message.begin(), message.end());
}

void assembler_seeds() {
  auto model = sample_model();
  for (uint8_t index : {1, 2, 3, 4, 5}) {
    const uint64_t bucket_bytes = kAssemblerBucketSizes[index];
    Bytes stream{index};
    // Two refits of the same model: merge buffers are reused by the second.
    for (uint64_t refit = 0; refit < 2; ++refit)
      for (const auto& b : buckets_for(model, bucket_bytes, refit)) put_frame(stream, protocol::encode(b));
    if (stream.size() > 16384) continue;
    write("assembler", "model_bucket_" + std::to_string(bucket_bytes), stream);
  }
  // A refit that ends with a split tensor half received, then a whole one.
  {
    Bytes stream{3};
    auto b = buckets_for({tensor("split", DType::kFloat32, {6})}, 8, 0);
    b[0].is_last = true;
    put_frame(stream, protocol::encode(b[0]));
    for (const auto& x : buckets_for(model, 8, 1)) put_frame(stream, protocol::encode(x));
    write("assembler", "incomplete_then_whole", stream);
  }
  // Tensors in place: a whole one and a chunk from a source region, the rest packed.
  {
    Bytes stream{3};
    protocol::BucketReady b;
    b.used_bytes = 16;
    protocol::edit_manifest(b).regions = {{{0x7f0000001000, 96, {7}}, MemoryKind::kHost}};
    protocol::edit_manifest(b).entries = {{tensor("a", DType::kFloat32, {4, 4}), Box::whole(), 0, 64, 32, 1},
                                          {tensor("b", DType::kUInt8, {40}), Box::whole(), 0, 24, 0, 1},
                                          {tensor("b", DType::kUInt8, {40}), Box::whole(), 24, 16, 0, 0}};
    b.is_last = true;
    put_frame(stream, protocol::encode(b));
    write("assembler", "in_place", stream);
  }
  // Replays (the harness numbers its refits 1, 2, ...): refit 1 in full, refit 2 replays every
  // bucket of it, refit 3 replays bucket 0 and sends bucket 1 anew with a tensor of bucket 0.
  {
    Bytes stream{3};
    auto b = buckets_for(model, 8, 1);
    for (const auto& x : b) put_frame(stream, protocol::encode(x));
    for (auto x : b) {
      x.replay_of = 1;
      put_frame(stream, protocol::encode(x));
    }
    auto first = b[0];
    first.replay_of = 2;
    put_frame(stream, protocol::encode(first));
    auto again = b[0];
    again.seq = 1;
    again.is_last = true;
    put_frame(stream, protocol::encode(again));
    write("assembler", "replays", stream);
  }
  // An abort in the middle of a refit.
  {
    Bytes stream{4};
    auto b = buckets_for(model, 64, 0);
    put_frame(stream, protocol::encode(b[0]));
    put_frame(stream, protocol::encode(abort_message(0, "stop")));
    for (const auto& x : b) put_frame(stream, protocol::encode(x));
    write("assembler", "abort_mid_refit", stream);
  }
}

// --- driver <-> worker channel frames ------------------------------------------------------------

void put_channel_frame(Bytes& stream, const nlohmann::json& message) {
  const auto frame = channel_frame::encode(message);
  stream.insert(stream.end(), frame.begin(), frame.end());
}

void channel_seeds() {
  using nlohmann::json;
  Bytes commands;
  put_channel_frame(commands, json{{"cmd", "memory"}});
  put_channel_frame(commands, json{{"cmd", "create"},
                                   {"bucket_bytes", 4096},
                                   {"session", json::binary({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16})}});
  put_channel_frame(commands, json{{"cmd", "prepare"}});
  put_channel_frame(commands, json{{"cmd", "init"},
                                   {"metadata", json::array({json::binary({1, 2}), json::binary({3})})},
                                   {"train", 1},
                                   {"rollout", 1}});
  put_channel_frame(commands, json{{"cmd", "exit"}});
  write("channel", "commands", commands);
  Bytes reply;
  put_channel_frame(reply, json{{"ok", false},
                                {"error", "destination rank 0 is stale"},
                                {"kind", "timeout"},
                                {"receive", {{"seconds", 0.25}, {"tensors", 459}}}});
  write("channel", "reply", reply);
  write("channel", "truncated", truncated(commands, 20));
  write("channel", "empty", {});
}

// --- local control socket frames -----------------------------------------------------------------

EndpointId sample_id(uint8_t first) {
  EndpointId id;
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(first + 7 * i);
  return id;
}

void put_bytes(Bytes& stream, const Bytes& bytes) { stream.insert(stream.end(), bytes.begin(), bytes.end()); }

void put_data_frame(Bytes& stream, uint8_t channel, const Bytes& payload) {
  put_bytes(stream, control_frame::encode_header(control_frame::FrameType::kData, channel, payload.size()));
  put_bytes(stream, payload);
}

void local_frame_seeds() {
  using control_frame::FrameType;
  const Bytes hello = control_frame::encode_hello(sample_id(1), sample_id(100));
  Bytes session = hello;
  put_data_frame(session, 0, {1, 2, 3, 4, 5});
  put_data_frame(session, 2, protocol::encode(done_message(1, 2)));
  put_data_frame(session, 7, {});
  put_bytes(session, control_frame::encode_header(FrameType::kBye, 0, 0));
  write("local_frame", "session", session);
  write("local_frame", "hello", hello);
  Bytes data_first;
  put_data_frame(data_first, 0, {9, 9});
  write("local_frame", "data_before_hello", data_first);
  Bytes two_hellos = hello;
  put_bytes(two_hellos, hello);
  write("local_frame", "second_hello", two_hellos);
  write("local_frame", "hello_bad_magic", flipped(hello, 7));
  write("local_frame", "hello_old_version", flipped(hello, 10));
  write("local_frame", "truncated", truncated(session, session.size() - 3));
  Bytes unknown_type = hello;
  put_bytes(unknown_type, {2, 0, 0, 0, 9, 0});
  write("local_frame", "unknown_type", unknown_type);
  write("local_frame", "4gib_frame", {0xff, 0xff, 0xff, 0xff, 2, 0});
  write("local_frame", "empty", {});
}

// --- local peer addresses, CUDA IPC keys, NCCL messages, UCX addresses --------------------------

LocalPeerAddress sample_peer_address() {
  LocalPeerAddress a;
  a.endpoint = sample_id(3);
  a.identity.process = sample_id(50);
  a.identity.pid = 4242;
  a.identity.host = "6d3b6a0e-8f1c-4b8e-9d7a-2f6c1e0b9a54/node-7";
  a.device = 3;
  a.bus_id = "0000:19:00.0";
  return a;
}

void local_peer_seeds() {
  write("local_peer", "cuda_ipc", encode_local_peer_address(kCudaIpcAddressMagic, sample_peer_address()));
  write("local_peer", "nccl", encode_local_peer_address(kNcclAddressMagic, sample_peer_address()));
  LocalPeerAddress bare;
  write("local_peer", "empty_strings", encode_local_peer_address(kNcclAddressMagic, bare));
  const Bytes good = encode_local_peer_address(kCudaIpcAddressMagic, sample_peer_address());
  write("local_peer", "old_version", flipped(good, 4));
  write("local_peer", "truncated", truncated(good, good.size() - 5));
  Bytes long_host = good;
  long_host[4 + 1 + 32 + 4 + 3] = 0x7f;  // the host's u32 length, high byte
  write("local_peer", "host_length_past_end", long_host);
  write("local_peer", "empty", {});
}

void cuda_ipc_key_seeds() {
  CudaIpcRegionKey key;
  key.exported = true;
  for (size_t i = 0; i < key.handle.size(); ++i) key.handle[i] = static_cast<uint8_t>(i * 13);
  key.offset = 1 << 20;
  key.owner = sample_id(9);
  key.process = sample_id(90);
  key.device = 1;
  write("cuda_ipc_key", "exported", encode_cuda_ipc_key(key));
  CudaIpcRegionKey host;
  host.owner = sample_id(9);
  write("cuda_ipc_key", "host_memory", encode_cuda_ipc_key(host));
  const Bytes good = encode_cuda_ipc_key(key);
  Bytes bad_flag = good;
  bad_flag[5] = 2;
  write("cuda_ipc_key", "exported_2", bad_flag);
  write("cuda_ipc_key", "old_version", flipped(good, 4));
  write("cuda_ipc_key", "truncated", truncated(good, 40));
  write("cuda_ipc_key", "empty", {});
}

void nccl_request_seeds() {
  write("nccl_request", "request", encode_nccl_request({7, 3, 4096, 1 << 20}));
  write("nccl_request", "request_extreme", encode_nccl_request({UINT64_MAX, UINT64_MAX, UINT64_MAX, UINT64_MAX}));
  write("nccl_request", "key", encode_nccl_key({sample_id(5), 12}));
  NcclSetup setup;
  setup.generation = 2;
  for (size_t i = 0; i < setup.id.size(); ++i) setup.id[i] = static_cast<uint8_t>(255 - i);
  write("nccl_request", "setup", encode_nccl_setup(setup));
  write("nccl_request", "reply", encode_nccl_reply({7, "region 3 is not registered (it was released)"}));
  write("nccl_request", "reply_empty", encode_nccl_reply({0, ""}));
  write("nccl_request", "truncated", truncated(encode_nccl_request({1, 2, 3, 4}), 31));
  write("nccl_request", "empty", {});
}

void ucx_address_seeds() {
  InstanceId id;
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(0x40 + i);
  Bytes worker(57);
  for (size_t i = 0; i < worker.size(); ++i) worker[i] = static_cast<uint8_t>(i * 31);
  const ProcessIdentity process{"0f4c6a1e-boot", 0x1234, "host-a", 4242, 987654};
  const Bytes good = encode_ucx_address(id, process, true, worker);
  write("ucx_address", "address", good);
  write("ucx_address", "no_error_handling", encode_ucx_address(id, process, false, worker));
  write("ucx_address", "one_byte_worker", encode_ucx_address(id, process, true, Bytes{1}));
  write("ucx_address", "empty_worker", encode_ucx_address(id, process, true, {}));
  write("ucx_address", "header", Bytes(id.begin(), id.end()));
  write("ucx_address", "bad_magic", flipped(good, 0));
  write("ucx_address", "truncated", truncated(good, good.size() - 1));
  write("ucx_address", "empty", {});
}

// --- safetensors headers -------------------------------------------------------------------------

// A file written by write_safetensors, read back as the seed.
void write_safetensors_seed(const std::string& name, const std::vector<SafetensorsEntry>& entries) {
  fs::create_directories(g_root / "safetensors");
  write_safetensors((g_root / "safetensors" / name).string(), entries);
  ++g_files;
}

// A hand-made file: 8-byte little-endian length, `header`, `data_bytes` of data.
void raw_safetensors(const std::string& name, const std::string& header, size_t data_bytes) {
  ByteWriter w;
  w.put_string<uint64_t>(header);
  Bytes file = w.take();
  file.resize(file.size() + data_bytes, 0x5a);
  write("safetensors", name, file);
}

void safetensors_seeds() {
  std::vector<std::byte> data(256);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i);
  const std::span<const std::byte> all(data);
  write_safetensors_seed("model", {{tensor("model.embed_tokens.weight", DType::kBFloat16, {4, 8}), all.first(64)},
                                   {tensor("model.norm.weight", DType::kFloat32, {8}), all.subspan(64, 32)},
                                   {tensor("empty", DType::kFloat16, {0, 3}), {}},
                                   {tensor("scale", DType::kFloat64, {}), all.subspan(96, 8)},
                                   {tensor("fp8", DType::kFloat8E4M3FN, {2, 3}), all.subspan(104, 6)}});
  write_safetensors_seed("no_tensors", {});
  raw_safetensors("overlap",
                  R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],)"
                  R"("data_offsets":[4,12]}})",
                  12);
  raw_safetensors("bad_dtype", R"({"w":{"dtype":"bfloat16","shape":[2],"data_offsets":[0,4]}})", 4);
  raw_safetensors("huge_shape", R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0);
  raw_safetensors("dim_past_int64", R"({"w":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,0]}})", 0);
  raw_safetensors("past_end", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 15);
  raw_safetensors("metadata_only", R"({"__metadata__":{"format":"pt"}})", 0);
  raw_safetensors("not_object", "[1,2,3]", 0);
  raw_safetensors("nested_shape", R"({"w":{"dtype":"U8","shape":[[[[[1]]]]],"data_offsets":[0,1]}})", 1);
  write("safetensors", "length_past_end", {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, '{', '}'});
  write("safetensors", "short", {2, 0, 0});
}

// A record of `changed` elements of a tensor of `elements` elements; the first byte of each seed
// is fuzz_delta's element-size selector.
void delta_seed(const std::string& name, size_t element_size, size_t elements, size_t changed, size_t stride) {
  std::vector<std::byte> old(elements * element_size), now;
  for (size_t i = 0; i < old.size(); ++i) old[i] = static_cast<std::byte>(i * 7 + 3);  // as fuzz_delta's tensor
  now = old;
  for (size_t k = 0; k < changed; ++k) now[(k * stride % elements) * element_size] ^= std::byte{0x5a};
  std::vector<uint8_t> record;
  if (!encode_delta(old, now, element_size, record).encoded) return;
  Bytes seed = {static_cast<uint8_t>(element_size == 1 ? 0 : element_size == 2 ? 1 : element_size == 4 ? 2 : 3)};
  seed.insert(seed.end(), record.begin(), record.end());
  write("delta", name, seed);
}

void delta_seeds() {
  delta_seed("gaps_bf16", 2, 64, 3, 17);
  delta_seed("bitmap_fp32", 4, 64, 30, 1);
  delta_seed("none_fp64", 8, 32, 0, 1);
  delta_seed("gaps_byte_long", 1, 4096, 5, 997);
  write("delta", "short", {1, 'R', 'F', 'D'});
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  g_root = argv[1];
  metadata_seeds();
  layout_seeds();
  message_seeds();
  assembler_seeds();
  channel_seeds();
  local_frame_seeds();
  local_peer_seeds();
  cuda_ipc_key_seeds();
  nccl_request_seeds();
  ucx_address_seeds();
  safetensors_seeds();
  delta_seeds();
  std::printf("wrote %d seed files under %s\n", g_files, g_root.c_str());
  return 0;
}
