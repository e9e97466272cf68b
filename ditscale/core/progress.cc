#include "ditscale/core/progress.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ditscale {

Progress::Progress(std::string label, int64_t total, bool enabled)
    : label_(std::move(label)),
      total_(total),
      enabled_(enabled),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

Progress::~Progress() { Finish(); }

bool Progress::DefaultEnabled() {
  const char* env = std::getenv("DITSCALE_PROGRESS");
  if (env != nullptr) return std::strcmp(env, "0") != 0;
  return isatty(STDERR_FILENO) != 0;
}

void Progress::Update(int64_t done) {
  done_ = done;
  if (!enabled_) return;
  auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < std::chrono::milliseconds(200)) return;
  last_draw_ = now;
  Draw(false);
}

void Progress::Finish() {
  if (finished_) return;
  finished_ = true;
  if (enabled_) Draw(true);
}

void Progress::Draw(bool final) {
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (total_ > 0) {
    double frac = static_cast<double>(done_) / static_cast<double>(total_);
    double eta = frac > 0 ? elapsed * (1 - frac) / frac : 0;
    std::fprintf(stderr, "\r%s  %lld/%lld (%.1f%%)  %.1f s, eta %.1f s   ", label_.c_str(),
                 static_cast<long long>(done_), static_cast<long long>(total_), 100 * frac, elapsed,
                 eta);
  } else {
    std::fprintf(stderr, "\r%s  %lld  %.1f s   ", label_.c_str(), static_cast<long long>(done_),
                 elapsed);
  }
  if (final) std::fputc('\n', stderr);
  std::fflush(stderr);
}

}  // namespace ditscale
