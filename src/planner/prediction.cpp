#include "refit/prediction.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <queue>
#include <set>

#include "core/delta_schedule.h"
#include "core/fail.h"
#include "core/host_threads.h"
#include "planner/paired_model.h"
#include "refit/ext/box_copy.h"
#include "refit/plan.h"
#include "refit/transfer_plan.h"

namespace refit {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- A fluid simulation: flows of bytes through shared resources, and timers. ----------------

class FlowSim {
 public:
  using Callback = std::function<void()>;

  // `crowded`: the capacity once more than `slots` flows cross it (a CPU node's cores, time-sliced).
  // `exclusive`: one flow at a time, the others wait their turn in order (a GPU's copies from
  // several processes: their contexts take turns); `crowded` is then its capacity while others
  // wait (what turns give), and `capacity` that of a flow alone.
  int add_resource(std::string name, double capacity, int slots = 0, double crowded = 0, bool exclusive = false) {
    names_.push_back(std::move(name));
    capacity_.push_back(capacity);
    slots_.push_back(slots);
    crowded_.push_back(crowded > 0 ? crowded : capacity);
    exclusive_.push_back(exclusive);
    waiting_.emplace_back();
    active_.push_back(0);
    bytes_.push_back(0);
    return static_cast<int>(capacity_.size()) - 1;
  }

  // A flow of `bytes` capped at `cap` through `resources` (-1 entries ignored); `done` runs when
  // the last byte has moved.
  void start_flow(double bytes, double cap, std::initializer_list<int> resources, Callback done) {
    Flow f;
    f.remaining = bytes;
    f.cap = cap > 0 ? cap : kInf;
    for (int r : resources)
      if (r >= 0) f.resources[f.count++] = r;
    f.done = std::move(done);
    for (int k = 0; k < f.count; ++k) {
      const int r = f.resources[k];
      if (exclusive_[r] && (active_[r] > 0 || !waiting_[r].empty())) {
        waiting_[r].push_back(std::move(f));
        return;
      }
    }
    admit(std::move(f));
  }

  void at(double time, Callback callback) { timers_.push({time, sequence_++, std::move(callback)}); }
  double now() const { return now_; }

  void run() {
    std::vector<Callback> finished;
    while (!flows_.empty() || !timers_.empty()) {
      // Equal shares of each resource; a flow moves at its scarcest share, or its own cap.
      double next = timers_.empty() ? kInf : timers_.top().time;
      for (auto& f : flows_) {
        double rate = f.cap;
        for (int k = 0; k < f.count; ++k) rate = std::min(rate, share(f.resources[k]));
        f.rate = rate;
        f.finish = now_ + (rate == kInf ? 0.0 : f.remaining / rate);
        next = std::min(next, f.finish);
      }
      if (next == kInf) fail(ErrorKind::kInternal, "planner: flows with no rate");
      const double dt = next - now_;
      const double slack = 1e-12 * std::max(1.0, next);
      now_ = next;
      finished.clear();
      std::vector<int> freed;
      for (size_t i = 0; i < flows_.size();) {
        Flow& f = flows_[i];
        if (f.finish <= next + slack) {
          for (int k = 0; k < f.count; ++k)
            if (--active_[f.resources[k]] == 0 && exclusive_[f.resources[k]]) freed.push_back(f.resources[k]);
          finished.push_back(std::move(f.done));
          flows_[i] = std::move(flows_.back());
          flows_.pop_back();
        } else {
          f.remaining -= f.rate * dt;
          ++i;
        }
      }
      for (int r : freed)
        if (active_[r] == 0 && !waiting_[r].empty()) {
          Flow f = std::move(waiting_[r].front());
          waiting_[r].pop_front();
          admit(std::move(f));
        }
      while (!timers_.empty() && timers_.top().time <= now_ + slack) {
        finished.push_back(timers_.top().callback);
        timers_.pop();
      }
      for (auto& c : finished) c();
    }
  }

  std::vector<ResourceDemand> demands() const {
    std::vector<ResourceDemand> out;
    for (size_t r = 0; r < capacity_.size(); ++r)
      if (bytes_[r] > 0) {
        const double capacity = std::isinf(capacity_[r]) ? crowded_[r] : capacity_[r];  // limited only when crowded
        out.push_back({names_[r], bytes_[r] / capacity, static_cast<uint64_t>(bytes_[r]), capacity});
      }
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
    return out;
  }

 private:
  struct Flow;
  void admit(Flow f) {
    for (int k = 0; k < f.count; ++k) {
      ++active_[f.resources[k]];
      bytes_[f.resources[k]] += f.remaining;
    }
    flows_.push_back(std::move(f));
  }
  double share(int r) const {
    const bool crowded = exclusive_[r] ? !waiting_[r].empty() : slots_[r] > 0 && active_[r] > slots_[r];
    return (crowded ? crowded_[r] : capacity_[r]) / active_[r];
  }
  struct Flow {
    double remaining = 0, cap = kInf, rate = 0, finish = 0;
    int resources[4] = {-1, -1, -1, -1};
    int count = 0;
    Callback done;
  };
  struct Timer {
    double time;
    uint64_t sequence;
    Callback callback;
    bool operator>(const Timer& o) const { return time != o.time ? time > o.time : sequence > o.sequence; }
  };
  double now_ = 0;
  uint64_t sequence_ = 0;
  std::vector<std::string> names_;
  std::vector<double> capacity_, crowded_;
  std::vector<int> slots_, active_;
  std::vector<bool> exclusive_;
  std::vector<std::deque<Flow>> waiting_;  // per exclusive resource, in arrival order
  std::vector<double> bytes_;
  std::vector<Flow> flows_;
  std::priority_queue<Timer, std::vector<Timer>, std::greater<>> timers_;
};

// ---- Where workers are and which resources their bytes cross. ---------------------------------

struct Place {
  const NodeGroup* group = nullptr;
  int node = 0;          // within its group
  int slot = 0;          // within its node
  std::string node_key;  // "group/node"
};

Place place_of(const Cluster& c, const ClusterSide& side, int rank) {
  Place p;
  p.group = &c.group(side.nodes);
  const int slot = side.first_slot + rank;
  p.node = slot / p.group->workers;
  p.slot = slot % p.group->workers;
  p.node_key = fmt::format("{}/{}", p.group->name, p.node);
  return p;
}

// The resources of a cluster, made on first use.
class Resources {
 public:
  Resources(FlowSim& sim) : sim_(sim) {}

  // A worker's copies: its GPU's copy engine; on a CPU node, the node's cores (each copy runs on
  // one) and its memory bandwidth.
  std::pair<int, int> copy(const Place& p) {
    if (p.group->gpu) {
      const int gpu = p.slot % std::max(p.group->gpus, 1);
      // A copy alone runs at its own rate; copies of several processes take turns, together at
      // the node copy rate.
      return {get(fmt::format("GPU {} copy (node {})", gpu, p.node_key), kInf, 0, p.group->node_copy_rate, true), -1};
    }
    const int cores = std::max(p.group->cores, 1);
    const std::string where = p.group->machine.empty() ? "node " + p.node_key : "machine " + p.group->machine;
    return {get(fmt::format("cores ({})", where), p.group->copy_rate * cores),
            get(fmt::format("memory ({})", where), p.group->node_copy_rate, cores, p.group->crowded_copy_rate)};
  }
  // A GPU worker's process's host threads (its delta records written or read).
  int host_threads(const Place& p) {
    return get(fmt::format("worker {} host threads (node {})", p.slot, p.node_key), kInf);
  }
  // A CPU node's in-place loads, together: limited to the crowded in-place rate once more of them
  // run than half its cores (their sources wait alongside them); -1 when not given.
  int in_place(const Place& p) {
    if (p.group->gpu || p.group->in_place_crowded_rate <= 0) return -1;
    const int cores = std::max(p.group->cores, 1);
    const std::string where = p.group->machine.empty() ? "node " + p.node_key : "machine " + p.group->machine;
    return get(fmt::format("in-place loads ({})", where), kInf, std::max(cores / 2, 1), p.group->in_place_crowded_rate);
  }
  // What a CPU node's kernel can push through TCP: measured with both ends on one machine, so a
  // node that is one end of a flow has twice that.
  int tcp(const Place& p) {
    if (p.group->tcp_rate <= 0)
      fail(ErrorKind::kConfig, "node group '{}': transfer.tcp is set, but its tcp rate is not given or calibrated",
           p.group->name);
    if (!p.group->machine.empty()) return get(fmt::format("TCP (machine {})", p.group->machine), p.group->tcp_rate);
    return get(fmt::format("TCP (node {})", p.node_key), 2 * p.group->tcp_rate);
  }
  int nic(const Place& p, bool in) {
    const double rate = p.group->rails * p.group->rail_rate;
    if (rate <= 0)
      fail(ErrorKind::kConfig, "node group '{}': bytes cross its nodes' NICs, but nic.rate is not given",
           p.group->name);
    const std::string who = p.group->nic_per_worker ? fmt::format("worker {} NIC", p.slot) : std::string("NIC");
    return get(fmt::format("{} {} (node {})", who, in ? "in" : "out", p.node_key), rate);
  }
  // A GPU's PCIe link to pinned host memory, each way.
  int pcie(const Place& p, bool to_host) {
    if (p.group->pcie_rate <= 0)
      fail(ErrorKind::kConfig, "node group '{}': transfer buffers in host memory, but pcie is not given",
           p.group->name);
    return get(fmt::format("GPU {} PCIe {} (node {})", p.slot % std::max(p.group->gpus, 1),
                           to_host ? "to host" : "from host", p.node_key),
               p.group->pcie_rate);
  }
  // Both ways of a GPU's PCIe link: no limit for one copy, and once copies go both ways each gets
  // the duplex rate (a pack to host buffers while the destination loads from them).
  int pcie_both_ways(const Place& p) {
    return get(fmt::format("GPU {} PCIe both ways (node {})", p.slot % std::max(p.group->gpus, 1), p.node_key), kInf, 1,
               2 * p.group->pcie_duplex_rate);
  }
  int nvlink(const Place& p, bool in) {
    if (p.group->nvlink_rate <= 0)
      fail(ErrorKind::kConfig, "node group '{}': GPUs of one node exchange bytes, but nvlink is not given",
           p.group->name);
    return get(
        fmt::format("GPU {} NVLink {} (node {})", p.slot % std::max(p.group->gpus, 1), in ? "in" : "out", p.node_key),
        p.group->nvlink_rate);
  }

 private:
  int get(const std::string& name, double capacity, int slots = 0, double crowded = 0, bool exclusive = false) {
    auto [it, fresh] = ids_.try_emplace(name, -1);
    if (fresh) it->second = sim_.add_resource(name, capacity, slots, crowded, exclusive);
    return it->second;
  }
  FlowSim& sim_;
  std::map<std::string, int> ids_;
};

bool same_gpu(const Place& a, const Place& b) {
  return a.node_key == b.node_key && a.slot % std::max(a.group->gpus, 1) == b.slot % std::max(b.group->gpus, 1);
}

// ---- The engine's pipeline, replayed. ---------------------------------------------------------

struct Flush {
  uint32_t link = 0;
  uint64_t bucket = 0;
  uint64_t bytes = 0;     // the bucket's used bytes
  uint64_t in_place = 0;  // ... and its bytes in place (the source's own tensors, not packed)
  uint64_t packed = 0;    // stream bytes copied since the source's previous flush
  bool last = false;
  uint64_t rows = 0;        // strided rows among those copies (each a copy of its own on a CPU)
  uint64_t pieces = 0;      // tensor pieces among those copies
  bool uses_buffer = true;  // the destination reads some of the bucket from the source's buffer
  DeltaWork work;           // delta refit: the source's comparing since its previous flush
};

struct SimLink {
  uint32_t source = 0, destination = 0;
  std::vector<uint64_t> buckets;  // used bytes
  std::vector<uint64_t> rows;     // strided rows in each bucket: the destination copies them out one by one
  std::vector<uint64_t> merged;   // tensors whose last chunk is in each bucket, when they arrive in
                                  // several: the destination then loads the whole tensor it assembled
  std::vector<uint64_t> pieces;   // tensor pieces in each bucket
  // Reads in place: each bucket's bytes the destination loads straight from the source's tensors
  // (no pack, no read), and the strided rows of those loads.
  std::vector<uint64_t> in_place, in_place_rows;
  // Delta refit: each bucket's patching at the destination (seconds alone), before it releases the
  // bucket, and what its loader then copies out of the destination's copy.
  std::vector<DeltaWork> patch;
  std::vector<uint64_t> load;
  bool mapped = false;
  // How the destination takes the source's tensors in its memory (direct_reads): maps them, or
  // (where it cannot map: another node) reads the large ones, the source packing only the rest.
  SourceAccess access = SourceAccess::kNone;
  uint64_t source_read_bytes = 0;  // ... so read
  // Source side.
  int64_t acknowledged = -1;    // highest bucket the source has seen acknowledged
  std::deque<int64_t> holding;  // announced buckets in the source's buffers, not acknowledged yet
  // Destination side (its reader, as LinkReader::advance): where it is with bucket next_fetch.
  enum class Fetch { kBuffer, kAnnouncement, kReading, kTaken, kDone };
  Fetch fetch = Fetch::kBuffer;
  std::vector<bool> announced;
  uint64_t next_fetch = 0;
  bool read_done = false;  // the read of bucket next_fetch is complete, not yet seen by the engine
  int64_t ready = -1;      // handed to the engine, not yet taken
  int64_t released = -1;   // highest bucket the engine is done with
};

class PipelineModel {
 public:
  PipelineModel(const Cluster& cluster, uint32_t sources, uint32_t destinations, double start)
      : cluster_(cluster), resources_(sim_), start_(start) {
    latency_ = std::max(cluster.transfer.latency_s, 0.0);
    turnaround_ = std::max(cluster.transfer.turnaround_s, 0.0);
    in_place_turnaround_ =
        cluster.transfer.in_place_turnaround_s >= 0 ? cluster.transfer.in_place_turnaround_s : turnaround_;
    ack_latency_ = cluster.transfer.ack_latency_s >= 0 ? cluster.transfer.ack_latency_s : latency_;
    // A link that reads in place hands off on its own measured latencies (only the destination
    // copies there, so the hand-offs compete with fewer copies for the CPU).
    in_place_latency_ = cluster.transfer.in_place_latency_s >= 0 ? cluster.transfer.in_place_latency_s : latency_;
    in_place_ack_latency_ =
        cluster.transfer.in_place_ack_latency_s >= 0 ? cluster.transfer.in_place_ack_latency_s : ack_latency_;
    for (uint32_t s = 0; s < sources; ++s) source_places_.push_back(place_of(cluster, cluster.sources, s));
    for (uint32_t d = 0; d < destinations; ++d)
      destination_places_.push_back(place_of(cluster, cluster.destinations, d));
    source_state_.resize(sources);
    destination_state_.resize(destinations);
    out_sources_.resize(sources);
    out_destinations_.resize(destinations);
    for (uint32_t s = 0; s < sources; ++s) out_sources_[s].worker = fmt::format("source {}", s);
    for (uint32_t d = 0; d < destinations; ++d) out_destinations_[d].worker = fmt::format("destination {}", d);
  }

  // A link and the buckets it carries, in the order its source fills them.
  uint32_t add_link(uint32_t s, uint32_t d) {
    SimLink link;
    link.source = s;
    link.destination = d;
    const Place& a = source_places_[s];
    const Place& b = destination_places_[d];
    // Same node: the destination maps the source's buffers and loads from them (when the
    // transport maps: UCX shared memory, CUDA IPC); NCCL always reads.
    link.mapped = a.node_key == b.node_key && cluster_.transfer.mapped && cluster_.transfer.transport != "nccl";
    // Reads in place: the destination also maps the source's own tensors, when its transport
    // maps them: UCX its shared memory (CPU processes, whose weights live there), CUDA IPC any
    // GPU allocation.
    const bool maps_tensors =
        a.group->gpu == b.group->gpu && cluster_.transfer.transport == (a.group->gpu ? "cuda_ipc" : "ucx");
    // UCX reads any registered memory of a peer (TransportCapabilities::reads_registered_memory).
    if (cluster_.transfer.direct_reads && link.mapped && maps_tensors)
      link.access = SourceAccess::kMap;
    else if (cluster_.transfer.direct_reads && !link.mapped && cluster_.transfer.transport == "ucx")
      link.access = SourceAccess::kRead;
    links_.push_back(std::move(link));
    source_state_[s].links.push_back(static_cast<uint32_t>(links_.size() - 1));
    destination_state_[d].links.push_back(static_cast<uint32_t>(links_.size() - 1));
    return static_cast<uint32_t>(links_.size() - 1);
  }
  SimLink& link(uint32_t k) { return links_[k]; }
  void add_flushes(uint32_t s, std::vector<Flush> flushes) { source_state_[s].flushes = std::move(flushes); }

  void run() {
    for (uint32_t s = 0; s < source_state_.size(); ++s) {
      for (uint32_t k : source_state_[s].links) links_[k].announced.assign(links_[k].buckets.size(), false);
      sim_.at(0, [this, s] { pack_next(s); });
    }
    sim_.run();
  }

  std::vector<PredictedWorker>& sources() { return out_sources_; }
  std::vector<PredictedWorker>& destinations() { return out_destinations_; }
  std::vector<ResourceDemand> demands() const { return sim_.demands(); }
  uint64_t in_place_bytes() const {
    uint64_t total = 0;
    for (const auto& l : links_) {
      for (uint64_t b : l.in_place) total += b;
      total += l.source_read_bytes;
    }
    return total;
  }

 private:
  struct SourceState {
    std::vector<uint32_t> links;
    std::vector<Flush> flushes;
    size_t next = 0;
    std::optional<std::pair<uint32_t, int64_t>> waiting;  // for this link's bucket to be acknowledged
  };
  struct DestinationState {
    std::vector<uint32_t> links;
    std::deque<uint32_t> ready;  // links with a bucket handed over, in the order they came
    bool loading = false;
  };

  double now() const { return start_ + sim_.now(); }
  bool host_buffers(const Place& p) const { return p.group->gpu && cluster_.transfer.host_buffers; }
  // A copy's bytes, plus what its strided rows cost (each row a copy of its own), as bytes.
  static double copy_bytes(const Place& p, uint64_t bytes, uint64_t rows) {
    return static_cast<double>(bytes) + static_cast<double>(rows) * p.group->row_cost_s * p.group->copy_rate;
  }
  // A bucket's copies cost time beyond their bytes (issuing them, waiting for them), which holds no
  // resource.
  static double copy_cost(const Place& p) { return std::max(p.group->copy_cost_s, 0.0); }
  // Starts a copy's flow; `done` runs once its bytes are through and its fixed costs are paid.
  void start_copy(double bytes, double cap, std::initializer_list<int> resources, double cost, FlowSim::Callback done) {
    if (cost <= 0) return sim_.start_flow(bytes, cap, resources, std::move(done));
    sim_.start_flow(bytes, cap, resources, [this, cost, done = std::move(done)] { sim_.at(sim_.now() + cost, done); });
  }
  void event(PredictedWorker& w, TimelinePhase phase, uint32_t peer, uint64_t bucket, double from, double to,
             uint64_t bytes, uint64_t pieces = 0) {
    w.events.push_back({phase, peer, bucket, from, to, bytes, static_cast<uint32_t>(pieces)});
    w.seconds = std::max(w.seconds, to);
  }

  // The source copies the stream up to its next flush, announces that bucket, and refills the
  // link's other buffer only once the destination is done with the bucket it holds.
  void pack_next(uint32_t s) {
    SourceState& st = source_state_[s];
    if (st.next == st.flushes.size()) return;
    const Flush f = st.flushes[st.next];
    const Place& p = source_places_[s];
    const double begun = now();
    // Not a structured binding: a lambda below captures them.
    const std::pair<int, int> copies = resources_.copy(p);
    int cores = copies.first, memory = copies.second;
    double cap = p.group->copy_rate;
    if (host_buffers(p)) {  // GPU tensors into pinned host buffers
      cores = resources_.pcie(p, true);
      memory = resources_.pcie_both_ways(p);
      cap = p.group->pcie_rate;
    }
    auto announce = [this, s, f, begun] {
      SimLink& l = links_[f.link];
      const double t = now();
      event(out_sources_[s], TimelinePhase::kPack, l.destination, f.bucket, begun, t, f.bytes, f.pieces);
      event(out_sources_[s], TimelinePhase::kAnnounce, l.destination, f.bucket, t, t, f.bytes);
      out_sources_[s].bytes += f.bytes + f.in_place;
      const uint32_t k = f.link;
      sim_.at(sim_.now() + (l.access == SourceAccess::kMap ? in_place_latency_ : latency_), [this, k, f] {
        links_[k].announced[f.bucket] = true;
        try_fetch(k);
      });
      SourceState& st = source_state_[s];
      ++st.next;
      // Both buffers hold unacknowledged buckets: the source waits for the older (LinkSender::flush).
      if (f.uses_buffer) l.holding.push_back(static_cast<int64_t>(f.bucket));
      if (!f.last && l.holding.size() == 2)
        st.waiting = std::pair(k, l.holding.front());
      else
        pack_next(s);
    };
    auto pack = [this, s, f, cores, memory, cap, announce] {
      const Place& p = source_places_[s];
      // A bucket of tensors in place only: nothing to copy or wait for, the source announces it.
      if (f.packed == 0 && f.rows == 0 && links_[f.link].access != SourceAccess::kNone)
        return sim_.at(sim_.now(), announce);
      start_copy(copy_bytes(p, f.packed, f.rows), cap, {cores, memory}, copy_cost(p), announce);
    };
    if (!f.work.any()) return pack();
    // Delta refit: the source compares what the bucket's records stand for first.
    work(p, f.work, pack);
  }

  // A worker's delta work: a flow through its cores and memory (its GPU), then one through its
  // process's host threads.
  void work(const Place& p, const DeltaWork& w, FlowSim::Callback done) {
    const auto [cores, memory] = resources_.copy(p);
    const double rate = work_rate(*p.group);
    auto on_host = [this, p, host = w.host * rate, rate, done = std::move(done)]() mutable {
      if (host <= 0) return done();
      sim_.start_flow(host, rate, {resources_.host_threads(p)}, std::move(done));
    };
    if (w.copies <= 0) return on_host();
    sim_.start_flow(w.copies * rate, rate, {cores, memory}, std::move(on_host));
  }

  void acknowledge(uint32_t k, uint64_t bucket) {
    sim_.at(sim_.now() + (links_[k].access == SourceAccess::kMap ? in_place_ack_latency_ : ack_latency_),
            [this, k, bucket] {
              SimLink& l = links_[k];
              l.acknowledged = std::max(l.acknowledged, static_cast<int64_t>(bucket));
              while (!l.holding.empty() && l.holding.front() <= l.acknowledged) l.holding.pop_front();
              const double t = now();
              event(out_sources_[l.source], TimelinePhase::kRelease, l.destination, bucket, t, t, 0);
              SourceState& st = source_state_[l.source];
              if (st.waiting && st.waiting->first == k && l.acknowledged >= st.waiting->second) {
                st.waiting.reset();
                pack_next(l.source);
              }
            });
  }

  // The destination's reader for link k, as LinkReader::advance: for each bucket, a free local
  // buffer (staged), its announcement, its read (staged), then the hand-over once the engine took
  // the one before; a staged bucket is acknowledged once read, a mapped one (or one in place) once
  // released (try_load). Readers move on while the engine loads (LinkProgress).
  void try_fetch(uint32_t k) {
    using Fetch = SimLink::Fetch;
    SimLink& l = links_[k];
    while (l.next_fetch < l.buckets.size()) {
      const uint64_t b = l.next_fetch;
      const bool once_loaded = l.mapped || l.in_place[b] > 0;
      switch (l.fetch) {
        case Fetch::kBuffer:
          if (!l.mapped && b >= 2 && l.released < static_cast<int64_t>(b - 2)) return;
          l.fetch = Fetch::kAnnouncement;
          [[fallthrough]];
        case Fetch::kAnnouncement:
          if (!l.announced[b]) return;
          if (!l.mapped && l.buckets[b] > 0) {
            l.fetch = Fetch::kReading;
            start_read(k, b);
            return;
          }
          if (!once_loaded) acknowledge(k, b);
          l.fetch = Fetch::kTaken;
          [[fallthrough]];
        case Fetch::kTaken:
          if (l.ready >= 0) return;
          hand_over(k, b);
          if (b + 1 < l.buckets.size()) {
            ++l.next_fetch;
            l.fetch = Fetch::kBuffer;
            continue;
          }
          l.fetch = Fetch::kDone;
          return;
        case Fetch::kReading:
          if (!l.read_done) return;
          l.read_done = false;
          if (l.in_place[b] == 0) acknowledge(k, b);
          l.fetch = Fetch::kTaken;
          continue;
        case Fetch::kDone:
          return;
      }
    }
  }

  // A staged read of bucket b of link k; once done, it is acknowledged and handed over.
  void start_read(uint32_t k, uint64_t b) {
    SimLink& l = links_[k];
    const Place& src = source_places_[l.source];
    const Place& dst = destination_places_[l.destination];
    const double begun = now();
    auto done = [this, k, b, begun] {
      SimLink& l = links_[k];
      event(out_destinations_[l.destination], TimelinePhase::kRead, l.source, b, begun, now(), l.buckets[b]);
      l.read_done = true;
      try_fetch(k);
    };
    const double bytes = static_cast<double>(l.buckets[b]);
    if (src.node_key != dst.node_key && cluster_.transfer.tcp && !src.group->gpu && !dst.group->gpu) {
      // Both ends' kernels spend CPU on every byte: the flow also crosses each end's TCP capacity
      // (once, when both ends are one machine).
      const int a = resources_.tcp(src), c = resources_.tcp(dst);
      sim_.start_flow(bytes, cluster_.transfer.read_rate,
                      {resources_.nic(src, false), resources_.nic(dst, true), a, a == c ? -1 : c}, done);
    } else if (src.node_key != dst.node_key) {
      sim_.start_flow(bytes, cluster_.transfer.read_rate, {resources_.nic(src, false), resources_.nic(dst, true)},
                      done);
    } else if (src.group->gpu && !same_gpu(src, dst) && !host_buffers(src)) {
      sim_.start_flow(bytes, cluster_.transfer.read_rate, {resources_.nvlink(src, false), resources_.nvlink(dst, true)},
                      done);
    } else {
      // Within one GPU or one host: a copy through its memory.
      const auto [cores, memory] = resources_.copy(dst);
      sim_.start_flow(bytes, cluster_.transfer.read_rate > 0 ? cluster_.transfer.read_rate : src.group->copy_rate,
                      {cores, memory}, done);
    }
  }

  void hand_over(uint32_t k, uint64_t b) {
    SimLink& l = links_[k];
    l.ready = static_cast<int64_t>(b);
    destination_state_[l.destination].ready.push_back(k);
    // Not from within the reader's step: the engine takes it as an event of its own.
    sim_.at(sim_.now(), [this, d = l.destination] { try_load(d); });
  }

  // The destination's engine loads one bucket at a time, in the order they arrived.
  void try_load(uint32_t d) {
    DestinationState& st = destination_state_[d];
    if (st.loading || st.ready.empty()) return;
    const uint32_t k = st.ready.front();
    st.ready.pop_front();
    SimLink& l = links_[k];
    const uint64_t b = static_cast<uint64_t>(l.ready);
    l.ready = -1;  // taken: the reader may hand over the next
    try_fetch(k);
    st.loading = true;
    const Place& dst = destination_places_[d];
    const Place& src = source_places_[l.source];
    const double begun = now();
    auto loaded = [this, k, b, d, begun] {
      SimLink& l = links_[k];
      auto& w = out_destinations_[d];
      event(w, TimelinePhase::kLoad, l.source, b, begun, now(), l.buckets[b] + l.in_place[b], l.pieces[b]);
      w.bytes += l.buckets[b] + l.in_place[b];
    };
    // The engine is done with the bucket: it goes back to its source (LinkReader::release).
    auto release = [this, k, b, d] {
      SimLink& l = links_[k];
      const double t = now();
      event(out_destinations_[d], TimelinePhase::kRelease, l.source, b, t, t, 0);
      l.released = static_cast<int64_t>(b);
      if (l.mapped || l.in_place[b] > 0) acknowledge(k, b);
      try_fetch(k);
    };
    // The engine turns to the next bucket after its measured turnaround.
    auto next = [this, k, d] {
      sim_.at(sim_.now() + (links_[k].access == SourceAccess::kMap ? in_place_turnaround_ : turnaround_), [this, d] {
        destination_state_[d].loading = false;
        try_load(d);
      });
    };
    if (l.patch[b].any() || l.load[b] > 0) {
      // Delta refit: the destination patches its copy from the bucket's records, releases the
      // bucket, then its loader copies the tensors out of its copy.
      return work(dst, l.patch[b], [this, k, b, d, loaded, release, next] {
        release();
        const Place& dst = destination_places_[d];
        const std::pair<int, int> copies = resources_.copy(dst);
        start_copy(static_cast<double>(links_[k].buckets[b] + links_[k].load[b]), dst.group->copy_rate,
                   {copies.first, copies.second}, copy_cost(dst), [loaded, next] {
                     loaded();
                     next();
                   });
      });
    }
    auto done = [loaded, release, next] {
      loaded();
      release();
      next();
    };
    const bool packed = l.buckets[b] > 0 || l.in_place[b] == 0;
    // Tensors in place are copied from the source's memory into the parameters at the in-place
    // load rate: as bytes of the bucket path's copy, they count copy_rate / in_place_copy_rate each.
    const double in_place = l.in_place[b] == 0 ? 0.0
                                               : copy_bytes(dst, l.in_place[b], l.in_place_rows[b]) *
                                                     dst.group->copy_rate / in_place_rate(dst);
    const double cost = (packed ? copy_cost(dst) : 0.0) + (l.in_place[b] > 0 ? in_place_cost(dst) : 0.0);
    const double bytes = copy_bytes(dst, l.buckets[b] + l.merged[b], l.rows[b]) + in_place;
    const auto [cores, memory] = resources_.copy(dst);
    if (host_buffers(dst)) {
      // Out of pinned host memory (ours, or the source's mapped) into the GPU; merging split
      // tensors happens in host memory, off this path. Tensors in place (CUDA IPC) come from the
      // source's GPU after that, over NVLink or within the GPU.
      start_copy(static_cast<double>(l.buckets[b]), dst.group->pcie_rate,
                 {resources_.pcie(dst, false), resources_.pcie_both_ways(dst)}, packed ? copy_cost(dst) : 0.0,
                 [this, k, b, done, in_place] {
                   SimLink& l = links_[k];
                   if (l.in_place[b] == 0) return done();
                   const Place& dst = destination_places_[l.destination];
                   const Place& src = source_places_[l.source];
                   const int copies = resources_.copy(dst).first;
                   if (same_gpu(src, dst))
                     start_copy(in_place, dst.group->copy_rate, {copies}, in_place_cost(dst), done);
                   else
                     start_copy(in_place, dst.group->copy_rate,
                                {copies, resources_.nvlink(src, false), resources_.nvlink(dst, true)},
                                in_place_cost(dst), done);
                 });
    } else if (l.mapped && dst.group->gpu && !same_gpu(src, dst)) {
      // Loading from a peer GPU's mapped buffer (or its tensors, in place) pulls the bytes over
      // NVLink; merged tensors are then loaded again from local memory, which costs what those
      // bytes would at NVLink's rate scaled by the local copy's.
      const double local = static_cast<double>(l.merged[b]) * dst.group->nvlink_rate / dst.group->copy_rate;
      start_copy(static_cast<double>(l.buckets[b]) + in_place + local, dst.group->copy_rate,
                 {cores, resources_.nvlink(src, false), resources_.nvlink(dst, true)}, cost, done);
    } else {
      start_copy(bytes, dst.group->copy_rate, {cores, memory, l.in_place[b] > 0 ? resources_.in_place(dst) : -1}, cost,
                 done);
    }
  }
  static double in_place_rate(const Place& p) {
    return p.group->in_place_copy_rate > 0 ? p.group->in_place_copy_rate : p.group->copy_rate;
  }
  static double in_place_cost(const Place& p) {
    return std::max(p.group->in_place_cost_s >= 0 ? p.group->in_place_cost_s : p.group->copy_cost_s, 0.0);
  }

  const Cluster& cluster_;
  FlowSim sim_;
  Resources resources_;
  double start_ = 0;
  double latency_ = 0, ack_latency_ = 0, turnaround_ = 0;
  double in_place_latency_ = 0, in_place_ack_latency_ = 0, in_place_turnaround_ = 0;
  std::vector<Place> source_places_, destination_places_;
  std::vector<SimLink> links_;
  std::vector<SourceState> source_state_;
  std::vector<DestinationState> destination_state_;
  std::vector<PredictedWorker> out_sources_, out_destinations_;
};

// Packs one source's pieces as its engine would: tensors in inventory order, each tensor's pieces
// to its links, every link with its own packer; returns the flushes in stream order.
struct PieceRef {
  uint32_t link;                      // index into the model's links
  TensorInfo info;                    // the piece, packed
  const TensorInfo* whole = nullptr;  // the tensor it is cut from
  Box box;                            // ... and where
  bool one_of_several = false;        // the destination gets this tensor in several pieces
  // Reads in place: the piece is one contiguous range of the source's memory (a whole tensor, or
  // a leading-dimension slice of what the source holds), as the engine requires of a piece it
  // sends in place; and the strided rows of its copy into the destination's tensor.
  bool contiguous = false;
  uint64_t in_place_rows = 0;
  Crossed delta;  // a delta refit's: `info` is its record
};

// How a source compares for a delta refit (SourceDelta::add): not at all (a full refit), each
// tensor as it comes, or in batches (GPU tensors, or host ones where its engine's pool has threads).
enum class Comparing { kNone, kEach, kInBatches };
Comparing comparing_of(const Cluster& cluster, bool delta) {
  const NodeGroup& g = cluster.group(cluster.sources.nodes);
  if (!delta) return Comparing::kNone;
  return g.gpu || host_pool_threads(g.cores) > 0 ? Comparing::kInBatches : Comparing::kEach;
}

// Whether `box` of a tensor of `shape` is one contiguous range of its bytes (LinkSender::add_in_place).
bool contiguous_box(std::span<const int64_t> shape, DType dtype, const Box& box, uint64_t size) {
  if (box.is_whole()) return true;
  uint64_t blocks = 0;
  bool contiguous = true;
  for_each_box_block(shape, dtype_size(dtype), box, 0, size, [&](const BoxBlock& b) {
    contiguous = contiguous && ++blocks == 1 && (b.rows <= 1 || b.pitch == b.row_bytes);
  });
  return contiguous;
}
// Strided rows of a copy of all of `box` in a tensor of `shape`: 0 when they are contiguous.
uint64_t box_rows(std::span<const int64_t> shape, DType dtype, const Box& box, uint64_t size) {
  if (box.is_whole() || size == 0) return 0;
  uint64_t rows = 0;
  for_each_box_block(shape, dtype_size(dtype), box, 0, size, [&](const BoxBlock& b) {
    if (b.rows > 1 && b.pitch != b.row_bytes) rows += b.rows;
  });
  return rows;
}

// Rows of a strided copy of bytes [begin, begin + size) of `box`: 0 when they are contiguous.
uint64_t strided_rows(const PieceRef& p, uint64_t begin, uint64_t size) {
  if (p.whole == nullptr || p.box.is_whole() || size == 0) return 0;
  uint64_t rows = 0;
  for_each_box_block(p.whole->shape, dtype_size(p.whole->dtype), p.box, begin, size, [&](const BoxBlock& b) {
    if (b.rows > 1) rows += b.rows;
  });
  return rows;
}
std::vector<Flush> pack_stream(const std::vector<std::vector<PieceRef>>& by_tensor, PipelineModel& model,
                               const std::vector<uint32_t>& links, const std::vector<uint64_t>& link_bytes,
                               Comparing comparing = Comparing::kNone) {
  std::map<uint32_t, BucketPacker> packers;
  std::map<uint32_t, uint64_t> used, count, rows, merged, pieces, in_place, in_place_rows, load;
  std::map<uint32_t, uint64_t> packed;  // chunks of the open bucket the source copies into it
  std::map<uint32_t, DeltaWork> patch;
  for (size_t i = 0; i < links.size(); ++i) {
    packers.emplace(links[i], BucketPacker(link_bytes[i]));
    used[links[i]] = count[links[i]] = rows[links[i]] = merged[links[i]] = pieces[links[i]] = 0;
    in_place[links[i]] = in_place_rows[links[i]] = packed[links[i]] = load[links[i]] = 0;
    patch[links[i]] = {};
  }
  std::vector<Flush> flushes;
  uint64_t since = 0, rows_since = 0, pieces_since = 0;
  DeltaWork work_since;
  auto flush = [&](uint32_t k, bool last) {
    // A bucket read wholly from the source's memory (nothing packed) leaves its buffer free.
    const bool uses_buffer = model.link(k).access == SourceAccess::kRead ? packed[k] > 0 : used[k] > 0;
    flushes.push_back(
        {k, count[k], used[k], in_place[k], since, last, rows_since, pieces_since, uses_buffer, work_since});
    SimLink& l = model.link(k);
    l.buckets.push_back(used[k]);
    l.rows.push_back(rows[k]);
    l.merged.push_back(merged[k]);
    l.pieces.push_back(pieces[k]);
    l.in_place.push_back(in_place[k]);
    l.in_place_rows.push_back(in_place_rows[k]);
    l.patch.push_back(patch[k]);
    l.load.push_back(load[k]);
    since = rows_since = pieces_since = 0;
    work_since = {};
    ++count[k];
    used[k] = rows[k] = merged[k] = pieces[k] = in_place[k] = in_place_rows[k] = packed[k] = load[k] = 0;
    patch[k] = {};
  };
  auto place = [&](const PieceRef& p) {
    // Where the engine puts it (route_piece); in place, the packer closes the group as it does
    // the engine's. (A small piece that continues a read is packed here: the model knows no
    // addresses.) A delta record lies in the source's host memory, which no transport maps.
    const uint64_t size = p.info.nbytes();
    SourceAccess access = model.link(p.link).access;
    if (comparing != Comparing::kNone && access == SourceAccess::kMap) access = SourceAccess::kNone;
    const PieceRoute route = route_piece(access, p.contiguous, size);
    if (route == PieceRoute::kMap) {
      if (packers.at(p.link).place_in_place(p.info, size)) flush(p.link, false);
      if (p.one_of_several) merged[p.link] += size;
      ++pieces[p.link];
      in_place[p.link] += size;
      in_place_rows[p.link] += p.in_place_rows;
      return;
    }
    // Read from the source's memory: placed in the bucket (the destination reads it there) but
    // not copied by the source.
    const bool read_there = route == PieceRoute::kRead;
    const auto chunks = packers.at(p.link).place(p.info);
    for (const ChunkPlacement& c : chunks) {
      if (c.starts_bucket) flush(p.link, false);
      // A tensor in several chunks is assembled, then loaded whole once its last chunk is in.
      if ((p.one_of_several || chunks.size() > 1) && c.tensor_offset + c.size == p.info.nbytes())
        merged[p.link] += p.info.nbytes();
      ++pieces[p.link];
      used[p.link] = c.bucket_offset + c.size;
      if (read_there) {
        model.link(p.link).source_read_bytes += c.size;
        continue;
      }
      ++pieces_since;
      ++packed[p.link];
      since += c.size;
      const uint64_t r = strided_rows(p, c.tensor_offset, c.size);
      rows_since += r;
      rows[p.link] += r;
    }
  };
  // Delta refit: each link's pieces waiting for their batch's comparison; once compared, their
  // records go into the link's bucket, which is sent as soon as it holds kBucketBytes
  // (LinkSender::send_early), and the destination patches each and loads its piece.
  std::map<uint32_t, std::vector<const PieceRef*>> waiting;
  std::map<uint32_t, uint64_t> waiting_bytes;
  auto compare = [&](uint32_t k) {
    for (const PieceRef* p : waiting[k]) work_since += p->delta.compare;
    for (const PieceRef* p : waiting[k]) {
      place(*p);
      patch[k] += p->delta.patch;
      load[k] += p->delta.load_bytes;
      if (used[k] >= delta_schedule::kBucketBytes) {
        flush(k, false);
        packers.at(k).close_bucket();
      }
    }
    waiting[k].clear();
    waiting_bytes[k] = 0;
  };
  for (const auto& tensor_pieces : by_tensor)
    for (const auto& p : tensor_pieces) {
      if (comparing == Comparing::kNone) {
        place(p);
        continue;
      }
      waiting[p.link].push_back(&p);
      waiting_bytes[p.link] += p.delta.load_bytes;  // the piece's bytes, which the source compares
      if (comparing == Comparing::kEach || waiting[p.link].size() >= delta_schedule::kBatchTensors ||
          waiting_bytes[p.link] >= delta_schedule::kBatchBytes)
        compare(p.link);
    }
  if (comparing != Comparing::kNone)
    for (uint32_t k : links) compare(k);  // SourceDelta::flush, then the trailer
  for (uint32_t k : links) flush(k, true);
  return flushes;
}

Prediction finish(PipelineModel& model, const Cluster& cluster, double gather, uint64_t bucket) {
  Prediction out;
  out.overhead_seconds = std::max(cluster.transfer.overhead_s, 0.0);
  out.gather_seconds = gather;
  out.bucket_bytes = bucket;
  out.sources = std::move(model.sources());
  out.destinations = std::move(model.destinations());
  double end = gather;
  for (const auto* side : {&out.sources, &out.destinations})
    for (const auto& w : *side) end = std::max(end, w.seconds);
  for (const auto& w : out.sources)
    for (const auto& e : w.events) out.buckets += e.phase == TimelinePhase::kAnnounce;
  out.seconds = end + out.overhead_seconds;
  out.demands = model.demands();
  out.in_place_bytes = model.in_place_bytes();
  if (!out.demands.empty()) {
    const auto& top = out.demands.front();
    out.bound =
        fmt::format("{} ({:.3f} s at {:.1f} GB/s); pipeline fill, drain, latencies and control {:.3f} s", top.name,
                    top.seconds, top.capacity / 1e9, std::max(0.0, out.seconds - gather - top.seconds));
  }
  return out;
}

void check_ranks(const Cluster& c, size_t holds, size_t needs, bool paired) {
  if (needs != static_cast<size_t>(c.destinations.ranks))
    fail(ErrorKind::kConfig, "cluster '{}': {} destination layouts for {} destination ranks", c.name, needs,
         c.destinations.ranks);
  if (!paired && holds != static_cast<size_t>(c.sources.ranks))
    fail(ErrorKind::kConfig, "cluster '{}': {} source layouts for {} source ranks", c.name, holds, c.sources.ranks);
  if (c.transfer.bucket_bytes == 0) fail(ErrorKind::kConfig, "cluster '{}': the bucket size is not set", c.name);
}

// The paired path: source i streams what destination i keeps (or, given `crossing`, what it makes
// of each piece), in one link with the whole bucket.
Prediction simulate_paired(const ModelInventory& model, std::span<const Layout> needs, const Cluster& cluster,
                           double start, const Crossing& crossing = {}) {
  const uint32_t pairs = static_cast<uint32_t>(needs.size());
  if (cluster.sources.ranks < static_cast<int>(pairs))
    fail(ErrorKind::kConfig,
         "cluster '{}': the paired path needs a source per destination ({} sources, {} destinations)", cluster.name,
         cluster.sources.ranks, pairs);
  PipelineModel pipeline(cluster, pairs, pairs, start);
  for (uint32_t i = 0; i < pairs; ++i) {
    const uint32_t k = pipeline.add_link(i, i);
    std::vector<std::vector<PieceRef>> by_tensor;
    for (const auto& t : model.tensors) {
      Selection s = select(needs[i], t);
      if (s.take == Take::kDrop) continue;
      if (crossing) {  // made by the source in its own memory, contiguous
        Crossed crossed = crossing(i, i, s.info, t);
        by_tensor.push_back({{k, crossed.record, nullptr, Box::whole(), false, true, 0, std::move(crossed)}});
        continue;
      }
      const Box box =
          s.take == Take::kSlice ? Box::of(Request::narrow(s.slice.dim, s.slice.start, s.slice.length)) : Box::whole();
      const bool contiguous = contiguous_box(t.shape, t.dtype, box, s.info.nbytes());
      by_tensor.push_back({{k, std::move(s.info), &t, box, false, contiguous, 0, {}}});
    }
    pipeline.add_flushes(i, pack_stream(by_tensor, pipeline, {k}, {cluster.transfer.bucket_bytes},
                                        comparing_of(cluster, static_cast<bool>(crossing))));
  }
  pipeline.run();
  return finish(pipeline, cluster, start, cluster.transfer.bucket_bytes);
}

}  // namespace

double work_rate(const NodeGroup& g) {
  if (g.gpu) return g.copy_rate;
  const double rate = g.copy_rate * (host_pool_threads(g.cores) + 1);
  return g.node_copy_rate > 0 ? std::min(rate, std::max(g.node_copy_rate, g.copy_rate)) : rate;
}

Prediction predict_refit(const ModelInventory& model, std::span<const Layout> holds, std::span<const Layout> needs,
                         const Cluster& cluster) {
  return predict_stream(model, holds, needs, cluster, {});
}

Prediction predict_stream(const ModelInventory& model, std::span<const Layout> holds, std::span<const Layout> needs,
                          const Cluster& cluster, const Crossing& crossing) {
  check_ranks(cluster, holds.size(), needs.size(), holds.empty());
  if (holds.empty()) return simulate_paired(model, needs, cluster, 0, crossing);
  const TransferPlan plan = plan_transfers(model, holds, needs);
  PipelineModel pipeline(cluster, plan.source_count(), plan.destination_count(), 0);
  uint64_t largest = 0;
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> pieces_of;  // (destination, tensor) -> pieces
  for (const TransferPiece& p : plan.pieces()) ++pieces_of[{p.destination, p.tensor}];
  for (uint32_t s = 0; s < plan.source_count(); ++s) {
    std::vector<uint32_t> links;
    std::vector<uint64_t> link_bytes;
    std::map<uint32_t, std::vector<PieceRef>> by_tensor;
    for (uint32_t d : plan.destinations_of(s)) {
      const uint32_t k = pipeline.add_link(s, d);
      links.push_back(k);
      link_bytes.push_back(plan.link_bucket_bytes(s, d, cluster.transfer.bucket_bytes));
      largest = std::max(largest, link_bytes.back());
      for (const TransferPiece& p : plan.link(s, d)) {
        const TensorInfo& t = model.tensors[p.tensor];
        // As the engine sees the piece: in the source's view (what it holds of the tensor) and in
        // the destination's tensor (what it keeps).
        const Slice none{-1, 0, 0};
        const Request held = holds[s].request_for(t.name), need = needs[d].request_for(t.name);
        TensorInfo piece{t.name, t.dtype, p.box.shape_in(t.shape)};
        if (crossing) {  // made by the source in its own memory, contiguous, a whole of its own
          const TensorInfo shard{t.name, t.dtype, Box::of(held).shape_in(t.shape)};
          Crossed crossed = crossing(s, d, piece, shard);
          by_tensor[p.tensor].push_back({k, crossed.record, nullptr, Box::whole(), false, true, 0, std::move(crossed)});
          continue;
        }
        const uint64_t size = p.box.nbytes_in(t);
        const bool contiguous = contiguous_box(Box::of(held).shape_in(t.shape), t.dtype,
                                               p.box.relative_to(held.take == Take::kSlice ? held.slice : none), size);
        const uint64_t rows = box_rows(Box::of(need).shape_in(t.shape), t.dtype,
                                       p.box.relative_to(need.take == Take::kSlice ? need.slice : none), size);
        by_tensor[p.tensor].push_back(
            {k, std::move(piece), &t, p.box, pieces_of.at({d, p.tensor}) > 1, contiguous, rows, {}});
      }
    }
    std::vector<std::vector<PieceRef>> ordered;
    for (auto& [tensor, pieces] : by_tensor) ordered.push_back(std::move(pieces));
    pipeline.add_flushes(
        s, pack_stream(ordered, pipeline, links, link_bytes, comparing_of(cluster, static_cast<bool>(crossing))));
  }
  pipeline.run();
  return finish(pipeline, cluster, 0, largest);
}

Prediction predict_paired(const ModelInventory& model, std::span<const Layout> holds, std::span<const Layout> needs,
                          const Cluster& cluster) {
  check_ranks(cluster, holds.size(), needs.size(), true);
  // The gather: every full tensor a paired source streams reaches its node once, over all the
  // node's rails, minus what the node's source ranks already hold; then each rank takes its
  // copy over NVLink (or the host's memory).
  double gather = 0;
  std::vector<uint64_t> gathered(needs.size(), 0);
  if (!holds.empty()) {
    struct NodeNeed {
      const NodeGroup* group = nullptr;
      std::set<uint32_t> tensors;
      std::set<std::pair<uint32_t, std::string>> held;  // distinct slices held on the node
      uint64_t held_bytes = 0, rank_bytes = 0;
    };
    std::map<std::string, NodeNeed> nodes;
    for (uint32_t i = 0; i < needs.size(); ++i) {
      const Place p = place_of(cluster, cluster.sources, static_cast<int>(i));
      auto& n = nodes[p.node_key];
      n.group = p.group;
      for (uint32_t t = 0; t < model.tensors.size(); ++t) {
        const TensorInfo& info = model.tensors[t];
        if (select(needs[i], info).take == Take::kDrop) continue;
        n.tensors.insert(t);
        const Request held = i < holds.size() ? holds[i].request_for(info.name) : Request::drop();
        const uint64_t own = held.take == Take::kDrop ? 0 : Box::of(held).nbytes_in(info);
        gathered[i] += info.nbytes() - own;
      }
      n.rank_bytes += gathered[i];
    }
    for (uint32_t s = 0; s < holds.size(); ++s) {
      const Place p = place_of(cluster, cluster.sources, static_cast<int>(s));
      auto it = nodes.find(p.node_key);
      if (it == nodes.end()) continue;
      for (uint32_t t : it->second.tensors) {
        const Request r = holds[s].request_for(model.tensors[t].name);
        if (r.take == Take::kDrop) continue;
        const Box box = Box::of(r);
        if (it->second.held.insert({t, to_string(box)}).second)
          it->second.held_bytes += box.nbytes_in(model.tensors[t]);
      }
    }
    for (const auto& [key, n] : nodes) {
      uint64_t needed = 0;
      for (uint32_t t : n.tensors) needed += model.tensors[t].nbytes();
      const uint64_t incoming = needed > n.held_bytes ? needed - n.held_bytes : 0;
      const double nic = n.group->rails * n.group->rail_rate * (n.group->nic_per_worker ? n.group->workers : 1);
      double t = 0;
      if (incoming > 0) {
        if (nic <= 0)
          fail(ErrorKind::kConfig, "node group '{}': the gather crosses its NICs, but nic.rate is not given",
               n.group->name);
        t = incoming / nic;
      }
      const double local = n.group->gpu ? n.group->nvlink_rate : n.group->node_copy_rate;
      if (local > 0) t = std::max(t, n.group->gpu ? 0.0 : n.rank_bytes / local);
      if (n.group->gpu && n.group->nvlink_rate > 0)
        for (uint32_t i = 0; i < needs.size(); ++i)
          if (place_of(cluster, cluster.sources, static_cast<int>(i)).node_key == key)
            t = std::max(t, gathered[i] / n.group->nvlink_rate);
      gather = std::max(gather, t);
    }
  }
  Prediction out = simulate_paired(model, needs, cluster, gather);
  for (uint32_t i = 0; i < needs.size() && i < out.sources.size(); ++i)
    if (gather > 0)
      out.sources[i].events.insert(out.sources[i].events.begin(),
                                   TimelineEvent{TimelinePhase::kGather, i, 0, 0, gather, gathered[i]});
  if (gather > 0) out.bound = fmt::format("the training side's gather {:.3f} s, then {}", gather, out.bound);
  return out;
}

}  // namespace refit
