// ditscale: planning and simulation for long-sequence DiT training and inference.
#include <cstdio>
#include <exception>
#include <new>

#include "ditscale/core/error.h"
#include "tools/cli.h"
#include "tools/write_file.h"

int main(int argc, char** argv) {
  CLI::App app{"ditscale: AdaptiveLoad training planner and SwiftFusion sequence-parallel planner"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "ditscale 0.1.0");
  ditscale::cli::RegisterPlanCommand(app);
  ditscale::cli::RegisterFitCommand(app);
  ditscale::cli::RegisterSpCommands(app);
  try {
    app.parse(argc, argv);
    // Output that was lost (a full disk, /dev/full, a closed pipe) is an error, not exit 0.
    ditscale::cli::FlushStdoutChecked();
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "ditscale: error: out of memory (std::bad_alloc): the inputs need more memory "
                 "than this machine has\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ditscale: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
