// A cluster, described for the planner: groups of identical nodes with their workers (GPUs, or
// processes on a CPU node), the rates that move bytes between and within them, and which workers
// run the sources and the destinations with which parallel layouts. Read from YAML
// (`refit plan --cluster FILE`; docs/PLANNER.md has the format); rates a file leaves out come from
// a calibration measured on the machine (`refit bench --baseline --calibration-out`).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace refit {

// Rates in bytes per second; 0: not given (a calibration may fill it in).
struct NodeGroup {
  std::string name;
  int count = 1;                 // nodes
  int workers = 1;               // worker slots per node: GPUs, or processes on a CPU node
  bool gpu = false;              // workers are GPUs (else host processes)
  int gpus = 0;                  // GPU nodes: GPUs per node (default: workers); workers share them round-robin
  int cores = 0;                 // CPU nodes: the cores every copy on the node shares
  bool nic_per_worker = true;    // each GPU has its own rails (else one NIC per node)
  int rails = 1;                 // NICs per GPU (or per node)
  double rail_rate = 0;          // each rail, each way
  double nvlink_rate = 0;        // GPU to GPU within a node, each way per GPU
  double pcie_rate = 0;          // GPU to pinned host memory, each way alone
  double pcie_duplex_rate = 0;   // ... each way while both ways are busy (0: pcie_rate)
  double copy_rate = 0;          // one worker's copy (device copy on a GPU, memcpy on one core)
  double node_copy_rate = 0;     // several copies at once, together (CPU: every core; GPU: one GPU's copies)
  double crowded_copy_rate = 0;  // CPU nodes: more copies at once than cores (0: node_copy_rate)
  uint64_t memory = 0;           // per worker: GPU memory, or host memory on a CPU node
  double row_cost_s = 0;         // each row of a strided copy, beyond its bytes (CPU: a memcpy call)
  double copy_cost_s = 0;        // each pack or load of a bucket, beyond its bytes (issuing its copies,
                                 // one per tensor piece, and waiting for them)
  // Reads in place (transfer.direct_reads): a destination's load straight from its source's own
  // tensors into its parameters, one worker (0: calibration, else copy_rate), and what each group
  // of tensors in place costs beyond its bytes (< 0: calibration, else copy_cost_s).
  double in_place_copy_rate = 0;
  double in_place_cost_s = -1;
  // CPU nodes: the in-place loads' rate, together, once more of them run than half the cores (each
  // load's source waits alongside it, polling, so the node runs twice as many processes as loads;
  // 0: calibration, else no such limit).
  double in_place_crowded_rate = 0;
  // CPU nodes that are really one machine (simulated hosts: network namespaces of one kernel)
  // name it here: their copies and TCP share its cores and memory. Empty: every node is its own.
  std::string machine;
  double tcp_rate = 0;  // CPU nodes: TCP both ends on one node (ucp_get over TCP loopback)
  // Delta refit: each changed element's cost beyond the bytes, in bytes' worth of the node's delta
  // work (a CPU node's host work; a GPU's copy rate, spent on its process's host threads),
  // comparing at a source and patching at a destination (< 0: calibration, else the planner's
  // own, measured on the host by bench/micro_delta.cpp and on one H100 by scripts/calibrate.sh --gpu).
  double compare_change_bytes = -1;
  double patch_change_bytes = -1;
};

struct ClusterSide {
  std::string nodes;  // the node group it runs on
  int ranks = 0;
  int first_slot = 0;  // the group's worker slot of rank 0 (slots run node by node)
  // Parallel sizes. Sources: tp, pp, dp, ep, etp (Megatron) or fsdp; none: every source holds the
  // whole model (the paired topology). Destinations: tp, ep, pp.
  std::map<std::string, int> parallel;
  bool shard_dense = false;    // destinations: dense tensors TP-sliced
  bool shard_experts = false;  // destinations: experts owned by EP rank and TP-sliced
};

struct ClusterTransfer {
  uint64_t bucket_bytes = 0;  // per buffer; 0: the engine's sizing from the workers' memory
  std::string transport;      // ucx (RDMA or TCP across nodes), cuda_ipc, nccl
  bool mapped = true;         // same-node destinations load straight from the source's buffers
  bool direct_reads = true;   // refit_cfg.nixl.direct_reads: a mapped destination whose transport maps the
                              // source's own tensors (CPU: UCX shared memory; GPU: CUDA IPC) loads them in
                              // place, without a pack; pieces that are not one contiguous range still go
                              // through buckets
  bool tcp = false;           // reads across nodes go through the kernels' TCP stacks, which spend CPU
                              // on every byte at both ends (UCX over TCP, no RDMA)
  bool host_buffers = false;  // GPU workers keep their transfer buffers in pinned host memory (packs
                              // and loads cross PCIe), as refit_cfg.nixl.device=cpu with GPU tensors
  double read_rate = 0;       // one read stream's ceiling (the transport's own); 0: calibration (UCX:
                              // ucp_get, NCCL: send/recv), else none
  double latency_s = -1;      // an announcement, until the destination starts on it; < 0: calibration
  double ack_latency_s = -1;  // an acknowledgement, until the source sees it; < 0: calibration, else latency
  double turnaround_s = -1;   // a destination's time between one load and the next; < 0: calibration
  // Links that read in place: their announcements, acknowledgements and turnaround between groups;
  // < 0: calibration, else latency_s, ack_latency_s and turnaround_s.
  double in_place_latency_s = -1, in_place_ack_latency_s = -1, in_place_turnaround_s = -1;
  double overhead_s = -1;  // the driver starting a refit and collecting it; < 0: calibration
};

struct Cluster {
  std::string name;
  std::string model;  // the model's config.json or directory; the command line may give it instead
  std::vector<NodeGroup> groups;
  ClusterSide sources, destinations;
  ClusterTransfer transfer;

  const NodeGroup& group(const std::string& name) const;  // throws Error(kConfig)
};

// Throws Error(kConfig) naming the file and the key for anything missing, unknown or malformed,
// and for sides that need more workers than their node group has.
Cluster load_cluster(const std::string& path);
Cluster parse_cluster(const std::string& yaml, const std::string& origin);

// Measured copy and transport rates of one machine kind, in bytes per second (0: not measured).
struct Calibration {
  std::string machine;
  double host_copy_rate = 0;            // memcpy, one core, large buffers
  std::string engine_device;            // where the bench that measured the engine's copies ran: cpu or cuda
  double engine_copy_rate = 0;          // the engine's own packs and loads, one at a time (a bench's timeline)
  double engine_node_copy_rate = 0;     // ... several at once (no more than cores), together
  double engine_crowded_copy_rate = 0;  // ... more at once than the host has cores, together
  double host_node_copy_rate = 0;       // memcpy on every core at once
  double row_cost_s = 0;                // each row of a strided host copy (short rows), beyond its bytes
  double engine_copy_cost_s = -1;       // the engine's packs and loads: each bucket's, beyond its bytes
  // Reads in place (direct_reads), from a bench whose destinations loaded in place: the loads'
  // rate (one at a time), each group's cost beyond its bytes, the turnaround between groups, and
  // the hand-offs' latencies on that path.
  double engine_in_place_copy_rate = 0;
  double engine_in_place_copy_cost_s = -1;
  double in_place_turnaround_s = -1;
  double in_place_latency_s = -1;                // an announcement until the destination starts on it
  double in_place_ack_latency_s = -1;            // an acknowledgement until the waiting source sees it
  double engine_in_place_crowded_copy_rate = 0;  // in-place loads together, more processes than cores
  int cores = 0;
  uint64_t host_memory = 0;            // total host memory (a CPU node's bucket sizing)
  double read_rate = 0;                // one transport read stream (ucp_get over loopback)
  double tcp_rate = 0;                 // ucp_get over TCP, both ends on this machine: its CPU's TCP capacity
  double latency_s = -1;               // one control message
  double ack_latency_s = -1;           // a destination's acknowledgement, until its waiting source sees it
  double turnaround_s = -1;            // a destination between one load and the next
  double overhead_s = -1;              // the driver's per-refit start and collection
  double device_copy_rate = 0;         // GPU device-to-device copy
  double pinned_copy_rate = 0;         // GPU to pinned host memory
  double duplex_pinned_copy_rate = 0;  // ... each way, both ways at once
  double peer_copy_rate = 0;           // GPU to GPU over NVLink
  double nccl_rate = 0;                // NCCL send/recv between two GPUs
  // A delta refit, one source into one destination (`refit bench --changed SHARE
  // refit_cfg.nixl.delta=true`, on engine_device's tensors): the bytes compared and the elements
  // changed per refit, and the median seconds per refit of the source's comparing and the
  // destination's patching.
  double delta_bytes = 0;
  double delta_changes = 0;
  double delta_compare_s = -1;
  double delta_patch_s = -1;
};

// A JSON file; reading merges into `into` (a later file's measured values win).
void load_calibration(const std::string& path, Calibration& into);
void save_calibration(const std::string& path, const Calibration& calibration);

// Fills every rate the cluster leaves out from the calibration; throws Error(kConfig) naming the
// node group and key of a rate neither gives.
void apply_calibration(Cluster& cluster, const Calibration& calibration);

// "400Gbit", "400Gb/s", "50GB/s", "2.1TB/s", "900MiB/s" -> bytes per second. Throws
// Error(kConfig) naming `key`.
double parse_rate(const std::string& text, const std::string& key);

}  // namespace refit
