#include "tools/cli.h"

namespace ditscale::cli {
void RegisterSpCommands(CLI::App& app) {}
}  // namespace ditscale::cli
