// The NCCL backend ("NCCL"): the reference's baseline data path, NCCL point-to-point, offered
// with pull semantics so that the engine runs the same manifests and buckets over it as over
// UCX or CUDA IPC, and the two compare like for like.
//
//   connect   opens the local control channel (transport/local_socket) and creates a 2-rank
//             communicator for the pair: the peer with the lower endpoint id is rank 0 and
//             sends the ncclUniqueId over the channel. Both peers must connect within
//             timeout_s of each other (the engine's init does). Non-blocking communicator: every
//             wait polls ncclCommGetAsyncError against a deadline and aborts on expiry.
//   read      sends "region R, offset O, length L" to the owner on the control channel and posts
//             ncclRecv into local memory; the owner's service thread answers with ncclSend from
//             its region (or an error reply naming what was wrong). Waits poll the stream, the
//             communicator's async error, error replies and the peer's liveness until the
//             deadline; any failure aborts the communicator (connect again to recover).
//   send/receive  control messages over the local channel.
//
// Limits: peers on one host (the control channel is a Unix socket); two ranks may not share a
// GPU (NCCL refuses it: use CUDA_IPC then); reads between a pair go one direction at a time.
// Memory: allocate_memory is cudaMalloc on the configured device; register_memory takes GPU
// memory only. Tested on GPUs only (tests/gpu), and the read test needs two GPUs.
//
// Init params: device ("cuda" or "cuda:N", default "cuda"), timeout_s (default 300: the
// communicator setup in connect() and the owner's wait for one send).
#pragma once

#include <map>
#include <memory>
#include <string>

#include "refit/ext/transport.h"

namespace refit {

std::unique_ptr<Transport> create_nccl_transport(const std::map<std::string, std::string>& init_params);

}  // namespace refit
