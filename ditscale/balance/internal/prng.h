// A small, fully specified PRNG for plans and simulations: splitmix64 (Steele, Lea, Flood 2014).
// Every draw is defined here bit for bit (no std:: distributions, whose output differs between
// standard libraries), so a plan is identical on every platform and every rank.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

namespace ditscale::balance::internal {

// One splitmix64 output step applied to x (a good 64-bit mixer on its own).
inline uint64_t Mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A stream key from (seed, epoch, purpose, index): distinct inputs give independent streams.
inline uint64_t StreamKey(uint64_t seed, int64_t epoch, uint64_t purpose, uint64_t index = 0) {
  uint64_t k = Mix64(seed);
  k = Mix64(k ^ static_cast<uint64_t>(epoch));
  k = Mix64(k ^ (purpose * 0xD6E8FEB86659FD93ull));
  return Mix64(k ^ index);
}

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t Next() {
    state_ += 0x9E3779B97F4A7C15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform integer in [0, n), n >= 1: Lemire's multiply-shift with rejection (unbiased).
  uint64_t Below(uint64_t n) {
    unsigned __int128 m = static_cast<unsigned __int128>(Next()) * n;
    uint64_t low = static_cast<uint64_t>(m);
    if (low < n) {
      const uint64_t threshold = (0 - n) % n;
      while (low < threshold) {
        m = static_cast<unsigned __int128>(Next()) * n;
        low = static_cast<uint64_t>(m);
      }
    }
    return static_cast<uint64_t>(m >> 64);
  }
  // Uniform double in [0, 1) with 53 random bits.
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  // Standard normal by Box-Muller (one of the pair; deterministic).
  double Normal() {
    double u1 = Uniform();
    const double u2 = Uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  uint64_t state_;
};

// Fisher-Yates shuffle of [first, first + n) driven by rng.
template <typename T>
void Shuffle(T* first, int64_t n, SplitMix64& rng) {
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(i) + 1));
    std::swap(first[i], first[j]);
  }
}

}  // namespace ditscale::balance::internal
