#include "tools/cli.h"

namespace ditscale::cli {
void RegisterPlanCommand(CLI::App& app) {}
}  // namespace ditscale::cli
