#include "calibration_out.h"
#include "median.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <map>
#include <thread>
#include <tuple>
#include <vector>

#include "refit/cluster.h"
#include "refit/error.h"
#include "refit/memory.h"

namespace refit::tools {
namespace {

using nlohmann::json;

struct Event {
  bool source = false;  // a source's event (else a destination's)
  uint64_t rank = 0, peer = 0, bucket = 0;
  std::string phase;
  double start = 0, end = 0, bytes = 0;
};

// The events of every refit that succeeded but the first (which also faults buffers in).
std::vector<std::vector<Event>> later_timelines(const json& refits) {
  std::vector<std::vector<Event>> out;
  for (size_t k = 1; k < refits.size(); ++k) {
    if (!refits[k].value("ok", false) || !refits[k].contains("timeline")) continue;
    auto& events = out.emplace_back();
    for (const auto& e : refits[k]["timeline"]) {
      const std::string worker = e.at("worker").get<std::string>();
      Event ev;
      ev.source = worker.starts_with("source ");
      ev.rank = std::stoull(worker.substr(worker.find(' ') + 1));
      ev.peer = e.at("peer").get<uint64_t>();
      ev.bucket = e.at("bucket").get<uint64_t>();
      ev.phase = e.at("phase").get<std::string>();
      ev.start = e.at("start").get<double>();
      ev.end = e.at("end").get<double>();
      ev.bytes = e.at("bytes").get<double>();
      events.push_back(std::move(ev));
    }
  }
  return out;
}

// A link's bucket: (source rank, destination rank, bucket).
using BucketKey = std::tuple<uint64_t, uint64_t, uint64_t>;
BucketKey key_of(const Event& e, int64_t bucket_offset = 0) {
  const uint64_t bucket = e.bucket + bucket_offset;
  return e.source ? BucketKey{e.rank, e.peer, bucket} : BucketKey{e.peer, e.rank, bucket};
}

double mean(double total, int count) { return count > 0 ? total / count : -1; }

// The driver's own share of a refit: from its start to the first bucket event, and from the last
// to its end (median over the refits that succeeded).
double control_overhead(const json& refits) {
  std::vector<double> v;
  for (const auto& r : refits) {
    if (!r.value("ok", false) || !r.contains("timeline") || r["timeline"].empty()) continue;
    double first = 1e300, last = 0;
    for (const auto& e : r["timeline"]) {
      first = std::min(first, e.at("start").get<double>());
      last = std::max(last, e.at("end").get<double>());
    }
    v.push_back(std::max(0.0, first) + std::max(0.0, r.at("seconds").get<double>() - last));
  }
  return median(v);
}

// The engine's own copy rates, from its packs and loads of 256 KiB or more, as the host's total
// rate for copies while one ran alone, while two or more ran (no more than cores: together) and
// while more ran than the host has cores (crowded). A copy's rate changes as others start and end,
// so the three are fitted together: copy i moved bytes_i = sum over the stretches it ran of
// length * R(class) / running, linear in R, solved by least squares over every copy.
struct CopyRates {
  double alone = 0, together = 0, crowded = 0;  // 0: not seen (or too little of the run)
  double overlapped = 0;                        // seconds during which copies overlapped
};
CopyRates engine_copy_rates(const std::vector<std::vector<Event>>& timelines) {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  double seconds[3] = {0, 0, 0};            // alone, together, crowded
  std::vector<std::array<double, 4>> rows;  // per copy: time-share of each class, bytes
  for (const auto& events : timelines) {
    struct Copy {
      double start, end, bytes;
    };
    std::vector<Copy> copies;
    for (const auto& e : events)
      if ((e.phase == "pack" || e.phase == "load") && e.bytes >= (256 << 10) && e.end > e.start)
        copies.push_back({e.start, e.end, e.bytes});
    // Sweep the copies' boundaries: each stretch between two has a set of copies running.
    std::vector<double> edges;
    for (const auto& c : copies) edges.insert(edges.end(), {c.start, c.end});
    std::sort(edges.begin(), edges.end());
    std::vector<std::array<double, 4>> share(copies.size(), {0, 0, 0, 0});
    for (size_t i = 0; i + 1 < edges.size(); ++i) {
      const double a = edges[i], b = edges[i + 1];
      if (b <= a) continue;
      std::vector<size_t> running;
      for (size_t k = 0; k < copies.size(); ++k)
        if (copies[k].start <= a && copies[k].end >= b) running.push_back(k);
      if (running.empty()) continue;
      const int n = static_cast<int>(running.size());
      const int kind = n == 1 ? 0 : n > cores ? 2 : 1;
      seconds[kind] += b - a;
      for (size_t k : running) share[k][kind] += (b - a) / n;
    }
    for (size_t k = 0; k < copies.size(); ++k) rows.push_back({share[k][0], share[k][1], share[k][2], copies[k].bytes});
  }
  // Normal equations over the classes seen, by Gaussian elimination (at most 3 unknowns).
  std::vector<int> seen;
  for (int k = 0; k < 3; ++k)
    if (seconds[k] > 0) seen.push_back(k);
  const size_t m = seen.size();
  std::vector<std::vector<double>> a(m, std::vector<double>(m + 1, 0));
  for (const auto& r : rows)
    for (size_t i = 0; i < m; ++i) {
      for (size_t j = 0; j < m; ++j) a[i][j] += r[seen[i]] * r[seen[j]];
      a[i][m] += r[seen[i]] * r[3];
    }
  double fitted[3] = {0, 0, 0};
  bool solved = m > 0;
  for (size_t c = 0; c < m && solved; ++c) {
    size_t pivot = c;
    for (size_t r = c + 1; r < m; ++r)
      if (std::abs(a[r][c]) > std::abs(a[pivot][c])) pivot = r;
    if (std::abs(a[pivot][c]) < 1e-300) solved = false;
    std::swap(a[c], a[pivot]);
    for (size_t r = 0; r < m && solved; ++r) {
      if (r == c) continue;
      const double f = a[r][c] / a[c][c];
      for (size_t j = c; j <= m; ++j) a[r][j] -= f * a[c][j];
    }
  }
  if (solved)
    for (size_t i = 0; i < m; ++i) fitted[seen[i]] = std::max(a[i][m] / a[i][i], 0.0);
  const double all = seconds[0] + seconds[1] + seconds[2];
  auto rate = [&](int kind, double min_share) { return seconds[kind] > min_share * all ? fitted[kind] : 0; };
  return {rate(0, 0), rate(1, 0.2), rate(2, 0.2), seconds[1] + seconds[2]};
}

// The copies of one refit (packs and loads, or loads only) that overlapped no other of them.
std::vector<const Event*> copies_alone(const std::vector<Event>& events, bool loads_only) {
  std::vector<const Event*> copies, alone;
  for (const auto& e : events)
    if ((e.phase == "load" || (!loads_only && e.phase == "pack")) && e.end > e.start) copies.push_back(&e);
  for (const Event* c : copies)
    if (std::none_of(copies.begin(), copies.end(),
                     [&](const Event* o) { return o != c && o->start < c->end && o->end > c->start; }))
      alone.push_back(c);
  return alone;
}

// What a pack or a load costs beyond its bytes at `rate`: the median over the copies that ran
// alone (issuing a bucket's copies, a tensor piece each, and waiting for them). -1 when fewer than
// 8 ran alone.
double copy_cost(const std::vector<std::vector<Event>>& timelines, double rate) {
  std::vector<double> residuals;
  for (const auto& events : timelines)
    for (const Event* c : copies_alone(events, false)) residuals.push_back((c->end - c->start) - c->bytes / rate);
  return rate > 0 && residuals.size() >= 8 ? std::max(median(residuals), 0.0) : -1;
}

// From a bucket's announcement until its destination starts on it (its read, or its load when
// mapped), over the buckets whose destination was idle by then (its previous load done). The
// mean, so that the scheduler's occasional stalls count.
double announcement_latency(const std::vector<std::vector<Event>>& timelines) {
  double total = 0;
  int count = 0;
  for (const auto& events : timelines) {
    std::map<BucketKey, double> announced, started, previous_done;
    for (const auto& e : events) {
      if (e.phase == "announce") announced[key_of(e)] = e.start;
      if (e.phase == "read" || e.phase == "load") {
        auto [it, fresh] = started.try_emplace(key_of(e), e.start);
        if (!fresh) it->second = std::min(it->second, e.start);
      }
      if (e.phase == "load") previous_done[key_of(e, 1)] = e.end;
    }
    for (const auto& [key, at] : announced) {
      auto s = started.find(key);
      auto p = previous_done.find(key);
      if (s == started.end() || (p != previous_done.end() && p->second > at)) continue;
      total += std::max(0.0, s->second - at);
      ++count;
    }
  }
  return mean(total, count);
}

// From a destination releasing a bucket until its source sees it, over the buckets whose source
// was waiting for it (it had announced the next one already).
double acknowledgement_latency(const std::vector<std::vector<Event>>& timelines) {
  double total = 0;
  int count = 0;
  for (const auto& events : timelines) {
    std::map<BucketKey, double> released, seen, announced;
    for (const auto& e : events) {
      if (e.phase == "release") (e.source ? seen : released)[key_of(e)] = e.start;
      if (e.phase == "announce") announced[key_of(e)] = e.start;
    }
    for (const auto& [key, at] : released) {
      auto s = seen.find(key);
      auto next = announced.find({std::get<0>(key), std::get<1>(key), std::get<2>(key) + 1});
      if (s == seen.end() || next == announced.end() || next->second > at) continue;
      total += std::max(0.0, s->second - at);
      ++count;
    }
  }
  return mean(total, count);
}

// A destination's turnaround: from the end of one load to the start of the next on the same
// link, when that bucket had been announced before the first load ended (its bytes were waiting).
double load_turnaround(const std::vector<std::vector<Event>>& timelines) {
  double total = 0;
  int count = 0;
  for (const auto& events : timelines) {
    std::map<BucketKey, std::pair<double, double>> loads;
    std::map<BucketKey, double> announced;
    for (const auto& e : events) {
      if (e.phase == "load") loads[key_of(e)] = {e.start, e.end};
      if (e.phase == "announce") announced[key_of(e)] = e.start;
    }
    for (const auto& [key, load] : loads) {
      const BucketKey next_key{std::get<0>(key), std::get<1>(key), std::get<2>(key) + 1};
      auto next = loads.find(next_key);
      auto ready = announced.find(next_key);
      if (next == loads.end() || ready == announced.end() || ready->second > load.second) continue;
      total += std::max(0.0, next->second.first - load.second);
      ++count;
    }
  }
  return mean(total, count);
}

// Reads in place (direct_reads): what the destinations loaded straight from their sources' tensors,
// per refit that succeeded but the first, with their loads (the in-place share from each refit's
// report).
struct InPlaceRefit {
  double bytes = 0;         // loaded in place
  double packed = 0;        // loaded from buckets
  double load_seconds = 0;  // the destinations' loads, together
  double load_span = 0;     // the time during which any destination loaded (the loads' union)
  int loads = 0;
  bool overlapped = false;  // two loads ran at once (several destinations)
};
std::vector<InPlaceRefit> in_place_refits(const json& refits) {
  std::vector<InPlaceRefit> out;
  for (size_t k = 1; k < refits.size(); ++k) {
    const json& r = refits[k];
    if (!r.value("ok", false) || !r.contains("timeline") || !r.contains("bytes_received")) continue;
    InPlaceRefit x;
    for (const auto& d : r["bytes_received"]) {
      x.bytes += d.value("in_place_bytes", 0.0);
      x.packed += d.value("bytes", 0.0) - d.value("in_place_bytes", 0.0);
    }
    std::vector<std::pair<double, double>> loads;
    for (const auto& e : r["timeline"])
      if (e.at("phase").get<std::string>() == "load")
        loads.push_back({e.at("start").get<double>(), e.at("end").get<double>()});
    std::sort(loads.begin(), loads.end());
    double covered = -1e300;
    for (size_t i = 0; i < loads.size(); ++i) {
      x.load_seconds += loads[i].second - loads[i].first;
      if (i > 0 && loads[i].first < loads[i - 1].second) x.overlapped = true;
      x.load_span += std::max(0.0, loads[i].second - std::max(loads[i].first, covered));
      covered = std::max(covered, loads[i].second);
    }
    x.loads = static_cast<int>(loads.size());
    out.push_back(x);
  }
  return out;
}

// What each load costs beyond its bytes: the intercept of load time against load bytes, fitted by
// least squares over the loads that ran alone, so that it does not depend on a rate measured in
// another run (the host's copy rate drifts by 10% from minute to minute). -1 when the loads are too
// few or all of one size.
double in_place_group_cost(const std::vector<std::vector<Event>>& timelines) {
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& events : timelines)
    for (const Event* c : copies_alone(events, true)) {
      const double x = c->bytes, y = c->end - c->start;
      n += 1;
      sx += x;
      sy += y;
      sxx += x * x;
      sxy += x * y;
    }
  const double spread = n * sxx - sx * sx;  // n^2 times the variance of the sizes
  if (n < 8 || spread <= 1e-6 * n * sxx) return -1;
  const double slope = (n * sxy - sx * sy) / spread;
  return std::max((sy - slope * sx) / n, 0.0);
}

// The share of a run's received bytes that went in place.
double in_place_share(const std::vector<InPlaceRefit>& refits) {
  double in_place = 0, all = 0;
  for (const auto& r : refits) {
    in_place += r.bytes;
    all += r.bytes + r.packed;
  }
  return all > 0 ? in_place / all : 0;
}

// A delta refit run measures delta refit's work alone (its copies are not a full refit's): the
// source's comparing and the destination's patching, medians over the refits that went as changes
// (all but the first), on the run's tensors (host or GPU: the file's engine_device).
void save_delta_calibration(const std::string& path, const json& run, Calibration& c) {
  auto refuse = [&](const std::string& why) {
    throw Error(ErrorKind::kInvalidArgument, fmt::format("--calibration-out {} with --changed: {}", path, why));
  };
  if (run.value("sources", 0u) != 1 || run.value("destinations", 0u) != 1 || run.value("sharded", false) ||
      run.value("resharding", false))
    refuse("delta refit's costs are measured from one source into one destination of the whole model");
  std::vector<double> compare, patch;
  const json& refits = run.at("refits");
  for (size_t k = 1; k < refits.size(); ++k) {
    const json& r = refits[k];
    if (!r.value("ok", false) || r.at("bytes_received").empty()) continue;
    const json& destination = r.at("bytes_received")[0];
    if (destination.value("delta_tensors", uint64_t{0}) == 0) continue;  // went whole
    compare.push_back(r.at("bytes_sent")[0].value("delta_seconds", 0.0));
    patch.push_back(destination.value("delta_seconds", 0.0));
  }
  if (compare.empty()) refuse("no refit went as changes: run it with refit_cfg.nixl.delta=true and --refits 2 or more");
  c.delta_bytes = run.at("model_bytes").get<double>();
  c.delta_changes = run.at("changed_elements").get<double>();
  c.delta_compare_s = median(compare);
  c.delta_patch_s = median(patch);
  save_calibration(path, c);
  fmt::print("calibration {}: delta refit of {:.0f} MiB, {:.0f} changes: comparing {:.1f} ms, patching {:.1f} ms\n",
             path, c.delta_bytes / (1 << 20), c.delta_changes, c.delta_compare_s * 1e3, c.delta_patch_s * 1e3);
}

}  // namespace

void save_bench_calibration(const std::string& path, const json& run) {
  Calibration c;
  if (std::filesystem::exists(path)) load_calibration(path, c);
  const std::string device = run.at("tensor_memory").get<std::string>();
  if (!c.engine_device.empty() && c.engine_device != device)
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("--calibration-out {}: it holds the engine's copy rates on {}, this "
                            "bench copies on {} (one file per kind of run)",
                            path, c.engine_device, device));
  c.engine_device = device;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  c.machine =
      fmt::format("{} cores, {:.0f} GiB, measured by refit bench", cores, total_host_memory_bytes() / 1073741824.0);
  c.host_memory = total_host_memory_bytes();
  if (run.contains("changed_elements")) {
    save_delta_calibration(path, run, c);
    return;
  }
  const auto timelines = later_timelines(run.at("refits"));
  const bool many_buckets = run.value("bucket_bytes", uint64_t{0}) * 8 <= run.value("model_bytes", uint64_t{0});
  // A run whose destinations read (nearly) everything in place measures that path only: the
  // in-place load rate with groups larger than the model (one group, a copy that runs alone), and
  // with many groups each group's cost beyond its bytes at that rate and the turnaround between
  // groups. The bucket path's values come from runs with direct_reads=false.
  const auto in_place = in_place_refits(run.at("refits"));
  if (in_place_share(in_place) >= 0.9) {
    std::vector<double> rates, crowded;
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    const bool more_than_cores = run.value("sources", 0u) + run.value("destinations", 0u) > cores;
    for (const auto& r : in_place) {
      // Several destinations loading at once while their sources wait: the node's rate for them all.
      if (r.overlapped && more_than_cores && r.load_span > 0) crowded.push_back((r.bytes + r.packed) / r.load_span);
      if (more_than_cores) continue;  // the rate alone and the costs come from one pair
      if (r.overlapped || r.loads == 0 || r.load_seconds <= 0) continue;
      rates.push_back((r.bytes + r.packed) / r.load_seconds);
    }
    if (!crowded.empty()) c.engine_in_place_crowded_copy_rate = median(crowded);
    if (!many_buckets && !rates.empty()) c.engine_in_place_copy_rate = median(rates);
    if (many_buckets && !more_than_cores)
      if (const double v = in_place_group_cost(timelines); v >= 0) c.engine_in_place_copy_cost_s = v;
    if (many_buckets && crowded.empty()) {
      if (const double v = load_turnaround(timelines); v >= 0) c.in_place_turnaround_s = v;
      if (const double v = announcement_latency(timelines); v >= 0) c.in_place_latency_s = v;
      if (const double v = acknowledgement_latency(timelines); v >= 0) c.in_place_ack_latency_s = v;
    }
    save_calibration(path, c);
    fmt::print(
        "calibration {}: in place ({:.0f}% of the bytes): the engine's loads {:.2f} GB/s ({:.2f} GB/s together with "
        "more processes than cores); {:.1f} us per group; "
        "turnaround {:.1f} us; latency {:.1f} us (acknowledgement {:.1f} us)\n",
        path, 100 * in_place_share(in_place), c.engine_in_place_copy_rate / 1e9,
        c.engine_in_place_crowded_copy_rate / 1e9, std::max(c.engine_in_place_copy_cost_s, 0.0) * 1e6,
        std::max(c.in_place_turnaround_s, 0.0) * 1e6, std::max(c.in_place_latency_s, 0.0) * 1e6,
        std::max(c.in_place_ack_latency_s, 0.0) * 1e6);
    return;
  }
  if (run.contains("baseline")) {
    const json& b = run["baseline"];
    c.host_copy_rate = b.at("memcpy_bytes_per_s").get<double>();
    c.host_node_copy_rate = b.at("all_cores_memcpy_bytes_per_s").get<double>();
    c.row_cost_s = b.at("strided_row_cost_s").get<double>();
    c.cores = static_cast<int>(cores);
    if (b.contains("ucp_get_bytes_per_s")) c.read_rate = b["ucp_get_bytes_per_s"].get<double>();
    if (b.contains("tcp_get_bytes_per_s")) c.tcp_rate = b["tcp_get_bytes_per_s"].get<double>();
    if (b.contains("message_latency_s")) c.latency_s = b["message_latency_s"].get<double>();
  }
  // A run measures the rate its copies ran at: alone (when none ever overlapped), together, or
  // crowded; and the hand-offs when its links carried many buckets.
  const CopyRates rates = engine_copy_rates(timelines);
  if (rates.alone > 0 && rates.overlapped == 0) c.engine_copy_rate = rates.alone;
  if (rates.together > 0 && rates.crowded == 0) c.engine_node_copy_rate = rates.together;
  if (rates.crowded > 0) c.engine_crowded_copy_rate = rates.crowded;
  if (many_buckets && rates.crowded == 0) {
    if (const double v = announcement_latency(timelines); v >= 0) c.latency_s = v;
    if (const double v = acknowledgement_latency(timelines); v >= 0) c.ack_latency_s = v;
    if (const double v = load_turnaround(timelines); v >= 0) c.turnaround_s = v;
    if (const double v = copy_cost(timelines, c.engine_copy_rate); v >= 0) c.engine_copy_cost_s = v;
  }
  if (const double overhead = control_overhead(run.at("refits")); overhead > 0) c.overhead_s = overhead;
  save_calibration(path, c);
  fmt::print(
      "calibration {}: the engine's copies {:.2f} GB/s alone, {:.2f} GB/s together, {:.2f} GB/s with more than "
      "cores; memcpy {:.2f} GB/s; read {:.2f} GB/s; latency {:.1f} us (acknowledgement {:.1f} us); turnaround "
      "{:.1f} us; copy cost {:.1f} us per bucket; refit overhead {:.2f} ms\n",
      path, c.engine_copy_rate / 1e9, c.engine_node_copy_rate / 1e9, c.engine_crowded_copy_rate / 1e9,
      c.host_copy_rate / 1e9, c.read_rate / 1e9, std::max(c.latency_s, 0.0) * 1e6, std::max(c.ack_latency_s, 0.0) * 1e6,
      std::max(c.turnaround_s, 0.0) * 1e6, std::max(c.engine_copy_cost_s, 0.0) * 1e6,
      std::max(c.overhead_s, 0.0) * 1e3);
}

}  // namespace refit::tools
