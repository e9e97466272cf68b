#include "tools/cli.h"

namespace ditscale::cli {
void RegisterFitCommand(CLI::App& app) {}
}  // namespace ditscale::cli
