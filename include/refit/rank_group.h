// A WorkerGroup whose workers are the ranks of a job started by a launcher people already use:
// mpirun, srun, torchrun, or one shell command per host. Each process is one rank; ranks
// [0, sources) are sources, the rest destinations (rank sources + r is destination r). The ranks
// meet at a rendezvous address where rank 0 listens: rank 0 drives the refits (this class), and
// every rank, rank 0 too (in a child process), serves its worker (serve_rank).
//
//   rank 0:       RankGroup group(options, env); WeightSynchronizer sync(config, group); ...
//   other ranks:  return serve_rank(options, env);
//
// Every rank must be given the same GroupOptions (same model, counts and config): the driver
// checks the counts and the model fingerprint when a rank joins and refuses a rank that differs.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "refit/process_group.h"
#include "refit/synchronizer.h"
#include "refit/worker_program.h"

namespace refit {

struct RankEnvironment {
  int rank = 0;
  int world_size = 1;
  std::string rendezvous_host;  // where rank 0 listens (an address of rank 0's host)
  int rendezvous_port = 0;
  std::string rendezvous_origin;  // what gave the address: --rendezvous, REFIT_RENDEZVOUS, MASTER_ADDR:MASTER_PORT
  // How long the ranks wait for each other at the rendezvous; 0: config.timeout_s, at least 60 s
  // (launchers start ranks over seconds).
  double join_timeout_s = 0;
};

// The rank environment a launcher sets: rank and world size from RANK/WORLD_SIZE (torchrun),
// OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE (Open MPI), PMI_RANK/PMI_SIZE (MPICH, Hydra) or
// SLURM_PROCID/SLURM_NTASKS (srun); the rendezvous from `rendezvous` ("host:port") if not
// empty, else REFIT_RENDEZVOUS, else MASTER_ADDR and MASTER_PORT. Throws Error(kConfig) naming
// what is missing or malformed.
RankEnvironment rank_environment(const std::string& rendezvous = "");

struct WorkerLink;  // private to src/sync

class RankGroup final : public ProcessGroup {
 public:
  // On rank 0: listens at the rendezvous address, starts this rank's own worker, and waits until
  // every rank has joined (deadline: env.join_timeout_s). Throws Error(kTopology) when the world
  // size is not sources + destinations, Error(kTimeout) naming the ranks that never joined,
  // Error(kProtocol) naming a rank whose model or counts differ.
  RankGroup(GroupOptions options, RankEnvironment env);
  // Tells every worker to exit; waits for none longer than a few seconds.
  ~RankGroup() override;

  // The host each worker runs on, sources first then destinations (as each reported it).
  std::vector<std::string> hosts() const;

 private:
  RankEnvironment env_;
  int own_worker_ = -1;  // pid of this rank's worker process
};

// On any rank but 0: joins the rendezvous (retrying until env.join_timeout_s, since rank 0 may
// start later; then Error(kTimeout) naming the address, this rank and what to check) and serves
// this rank's worker until the driver says exit or goes away. Returns the process exit code.
int serve_rank(const GroupOptions& options, const RankEnvironment& env);

}  // namespace refit
