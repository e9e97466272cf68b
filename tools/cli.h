// Subcommand registration for the ditscale CLI. Each command family lives in its own file.
#pragma once

#include <CLI/CLI.hpp>

namespace ditscale::cli {

void RegisterPlanCommand(CLI::App& app);  // `ditscale plan`   (tools/cli_plan.cc)
void RegisterFitCommand(CLI::App& app);   // `ditscale fit`    (tools/cli_fit.cc)
void RegisterSpCommands(CLI::App& app);   // `ditscale sp ...` (tools/cli_sp.cc)

}  // namespace ditscale::cli
