// The `refit` command: bench, plan, demo, chaos, info.
#include <fmt/format.h>
#include <spdlog/cfg/env.h>
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include "bench.h"
#include "chaos.h"
#include "demo.h"
#include "info.h"
#include "plan_command.h"
#include "refit/error.h"
#include "refit/logging.h"
#include "refit/version.h"

namespace {

// The one line a failed command ends with; returns its exit status.
int print_error(const refit::Error& e) {
  fmt::print(stderr, "refit: error ({}): {}\n", refit::to_string(e.kind()), e.what());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"refit: move freshly trained LLM weights from training to inference processes"};
  app.set_version_flag("--version", std::string("refit ") + refit::kVersionString);
  app.require_subcommand(1);

  refit::tools::BenchOptions bench;
  auto* bench_cmd =
      app.add_subcommand("bench", "Run refits between local source and destination processes and check every tensor");
  bench_cmd->add_option(
      "--model", bench.model,
      "config.json, safetensors file or directory, or builtin:refit-tiny-moe (the default, compiled in)");
  bench_cmd->add_flag(
      "--fp8", bench.fp8,
      "FP8 weights as DeepSeek-V3 and Qwen3 FP8 checkpoints hold them: each linear weight float8_e4m3fn with "
      "its 128x128 block scales (<name>_scale_inv), sliced with its weight");
  bench_cmd->add_option("--sources", bench.sources, "Source (policy) processes")->capture_default_str();
  bench_cmd->add_option("--destinations", bench.destinations, "Destination (rollout) processes")->capture_default_str();
  bench_cmd->add_option("--refits", bench.refits, "Refits to run")->capture_default_str();
  bench_cmd->add_option("--changed", bench.changed,
                        "A delta workload: each refit after the first moves this share of every tensor's elements "
                        "by one or two units in the last place, as an optimizer step does (0: all new content every "
                        "refit); with refit_cfg.nixl.delta=true only the changes travel");
  bench_cmd->add_option("--versions", bench.versions,
                        "A folder of consecutive versions of the weights (*.safetensors in name order, e.g. from "
                        "python/bench/delta_workload.py --save-dir): refit k sends version k (instead of --model)");
  bench_cmd->add_option("--config", bench.config_file, "YAML config file");
  bench_cmd->add_option("--json", bench.json_path, "Write results as JSON to this file");
  bench_cmd->add_flag("--baseline", bench.baseline, "Also measure ucx_perftest ucp_get and memcpy at the bucket size");
  bench_cmd->add_option("--calibration-out", bench.calibration_out,
                        "Merge what this run measured (the engine's copy rates from its timeline; with --baseline also "
                        "memcpy, ucx_perftest read and latency) into this planner calibration file (refit plan "
                        "--cluster --calibration); scripts/calibrate.sh runs the two benches it needs");
  bench_cmd->add_option("--kill", bench.kill,
                        "Failure test: ROLE:RANK:REFIT:STEP[:WHEN] kills that worker at that point, e.g. source:0:1:25 "
                        "or destination:0:1:0:after (WHEN, a destination's: load, the default, or after)");
  bench_cmd->add_option("--device", bench.device,
                        "Transfer buffers: cpu, cuda or cuda:N (refit_cfg.nixl.device; cuda also sets "
                        "backend_name=CUDA_IPC, which an override may change)");
  bench_cmd->add_option("--tensors", bench.tensors,
                        "Where weights and parameters live: cpu or cuda (default: as --device)");
  bench_cmd
      ->add_option("--launcher", bench.launcher,
                   "local: fork the workers here; env: this process is one rank of a job started by mpirun, srun, "
                   "torchrun or a command per host (RANK/WORLD_SIZE or the launcher's own; rank 0 drives)")
      ->capture_default_str();
  bench_cmd->add_option("--rendezvous", bench.rendezvous,
                        "With --launcher env: HOST:PORT where rank 0 listens (default REFIT_RENDEZVOUS, else "
                        "MASTER_ADDR:MASTER_PORT)");
  bench_cmd
      ->add_option("--join-timeout", bench.join_timeout_s,
                   "With --launcher env: seconds the ranks wait for each other at the rendezvous (default "
                   "refit_cfg.nixl.timeout_s, at least 60)")
      ->check(CLI::PositiveNumber);
  bench.parallel.add_to(*bench_cmd);
  bench.source_parallel.add_to(*bench_cmd);
  bench_cmd->add_flag("--compare-paired", bench.compare_paired,
                      "With --src-*: also time the paired path for the same job (a gather of the shards into one full "
                      "copy per destination, then the paired refit), in this run");
  bench_cmd->add_option("overrides", bench.overrides,
                        "Config overrides, key=value (e.g. refit_cfg.nixl.bucket_bytes=256MiB)");

  refit::tools::PlanOptions plan;
  auto* plan_cmd = app.add_subcommand("plan", "Show how a model is laid out in buckets, without moving bytes");
  plan_cmd->add_option(
      "--model", plan.model,
      "config.json, safetensors file or directory, or builtin:refit-tiny-moe (the default, compiled in)");
  plan_cmd->add_flag(
      "--fp8", plan.fp8,
      "FP8 weights as DeepSeek-V3 and Qwen3 FP8 checkpoints hold them: each linear weight float8_e4m3fn with "
      "its 128x128 block scales (<name>_scale_inv), sliced with its weight");
  plan_cmd->add_option("--sources", plan.sources, "Source processes")->capture_default_str();
  plan_cmd->add_option("--destinations", plan.destinations, "Destination processes")->capture_default_str();
  plan_cmd->add_option("--config", plan.config_file, "YAML config file");
  plan_cmd->add_option("--json", plan.json_path, "Write the plan summary as JSON to this file");
  plan_cmd->add_option("--target-memory", plan.target_memory,
                       "Total memory of each worker's transfer device on the target (e.g. 141GiB for an H200 with "
                       "refit_cfg.nixl.device=cuda); default: this host's memory");
  plan.parallel.add_to(*plan_cmd);
  plan.source_parallel.add_to(*plan_cmd);
  plan_cmd->add_option("--cluster", plan.cluster,
                       "Predict one refit on the cluster this YAML file describes (docs/PLANNER.md): refit's path and "
                       "the paired path, with what bounds each");
  plan_cmd->add_option(
      "--calibration", plan.calibrations,
      "Measured rates (refit bench --baseline --calibration-out) for what the cluster file leaves out");
  plan_cmd->add_option("--changed", plan.changed,
                       "With --cluster: also predict a delta refit (refit_cfg.nixl.delta) when this share of every "
                       "tensor's elements changed since the last refit (paired or resharding), and whether it pays");
  plan_cmd->add_option("overrides", plan.overrides, "Config overrides, key=value");

  refit::tools::ElasticOptions elastic;
  auto* demo_cmd = app.add_subcommand("demo", "Demonstrations of the refit lifecycle");
  demo_cmd->require_subcommand(1);
  auto* elastic_cmd =
      demo_cmd->add_subcommand("elastic", "Refit while the set of destinations changes (the reference's elastic demo)");
  elastic_cmd->add_option("--sequence", elastic.sequence, "Destination count per phase")->capture_default_str();
  elastic_cmd->add_option("--bucket-mb", elastic.bucket_mb, "Bucket size in MiB")->capture_default_str();
  elastic_cmd->add_option("--tensor-mb", elastic.tensor_mb, "Size of the dense tensor in MiB")->capture_default_str();
  elastic_cmd->add_option("--config", elastic.config_file, "YAML config file");
  elastic_cmd->add_option("overrides", elastic.overrides, "Config overrides, key=value");

  refit::tools::ChaosOptions chaos;
  auto* chaos_cmd = app.add_subcommand(
      "chaos", "Fault injection: kill workers at random points of refits and check detection and recovery");
  chaos_cmd->add_option("--trials", chaos.trials, "Trials to run")->capture_default_str();
  chaos_cmd->add_option("--seed", chaos.seed, "Random seed")->capture_default_str();
  chaos_cmd->add_option("--sources", chaos.sources, "Source processes")->capture_default_str();
  chaos_cmd->add_option("--destinations", chaos.destinations, "Destination processes")->capture_default_str();
  chaos_cmd->add_option("--timeout", chaos.timeout_s, "Deadline of every wait, seconds")->capture_default_str();
  chaos_cmd->add_option("--json", chaos.json_path, "Write every trial as JSON to this file");
  chaos_cmd->add_option("overrides", chaos.overrides, "Config overrides, key=value");

  refit::tools::InfoOptions info;
  auto* info_cmd = app.add_subcommand(
      "info",
      "Show what refit detects (version, GPUs, transports and why one is unavailable) and the effective config");
  info_cmd->add_option("--config", info.config_file, "YAML config file");
  info_cmd->add_option("overrides", info.overrides, "Config overrides, key=value");
  info_cmd->add_flag("--keys", info.keys,
                     "Print the configuration table instead: every refit_cfg.nixl key, backend init param and "
                     "environment variable with its type, default and meaning");
  info_cmd->add_flag("--json", info.json, "With --keys: the table as JSON")->needs("--keys");

  try {
    app.parse(argc, argv);
    spdlog::cfg::load_env_levels();  // SPDLOG_LEVEL=debug shows per-bucket timings
    refit::log_to_stderr("driver");
    if (bench_cmd->parsed()) return refit::tools::run_bench(bench);
    if (plan_cmd->parsed()) return refit::tools::run_plan(plan);
    if (elastic_cmd->parsed()) return refit::tools::run_elastic_demo(elastic);
    if (chaos_cmd->parsed()) return refit::tools::run_chaos(chaos);
    if (info_cmd->parsed()) return refit::tools::run_info(info);
  } catch (const CLI::ParseError& e) {
    // --help and --version end the parse too, with CLI11's text and exit status 0.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    std::string command = "refit";  // the (sub)command whose arguments were refused
    for (const CLI::App* at = &app; !at->get_subcommands().empty();) {
      at = at->get_subcommands().front();
      command += " " + at->get_name();
    }
    return print_error(
        refit::Error(refit::ErrorKind::kInvalidArgument, fmt::format("{}; see `{} --help`", e.what(), command)));
  } catch (const refit::Error& e) {
    return print_error(e);
  } catch (const std::exception& e) {
    fmt::print(stderr, "refit: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
