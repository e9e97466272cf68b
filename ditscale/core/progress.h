// A progress line on stderr for long work: "label  1234/10000 (12.3%)  4.1 s, eta 29.0 s".
// Redraws at most every 0.2 s; prints nothing when disabled (e.g. --quiet or not a terminal
// and DITSCALE_PROGRESS unset).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace ditscale {

class Progress {
 public:
  // total: number of units of work (0 when unknown); enabled: draw or stay silent.
  Progress(std::string label, int64_t total, bool enabled);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Sets the number of units done so far and redraws if due.
  void Update(int64_t done);
  // Draws the final line and a newline (called by the destructor if not called before).
  void Finish();

  // True when stderr is a terminal or DITSCALE_PROGRESS=1.
  static bool DefaultEnabled();

 private:
  void Draw(bool final);
  std::string label_;
  int64_t total_;
  int64_t done_ = 0;
  bool enabled_;
  bool finished_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace ditscale
