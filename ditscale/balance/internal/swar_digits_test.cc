// The word-parallel number parse must accept exactly what a byte loop accepts, with the same
// value, whatever bytes follow the field; and FastValidateRow must give the same sample with it
// (padded) as without.
#include "ditscale/balance/internal/swar_digits.h"

#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ditscale/balance/internal/manifest_rows.h"

namespace ditscale::balance::internal {
namespace {

// The byte-loop rules: plain digits; digits [ '.' digits ].
std::optional<uint64_t> LoopDigits(const std::string& s) {
  if (s.empty()) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

std::optional<std::pair<uint64_t, int>> LoopDecimal(const std::string& s) {
  const size_t dot = s.find('.');
  if (dot == std::string::npos) {
    auto v = LoopDigits(s);
    if (!v) return std::nullopt;
    return std::make_pair(*v, 0);
  }
  const std::string a = s.substr(0, dot), b = s.substr(dot + 1);
  if (!LoopDigits(a) || !LoopDigits(b)) return std::nullopt;
  return std::make_pair(*LoopDigits(a + b), static_cast<int>(b.size()));
}

// Checks one field (1..8 bytes) followed by `tail` (8 bytes) against the loops.
void Check(const std::string& field, const std::string& tail) {
  ASSERT_TRUE(field.size() >= 1 && field.size() <= 8 && tail.size() >= 8);
  const std::string buf = field + tail;
  const std::string ctx = "field '" + field + "' (" + std::to_string(field.size()) + " bytes)";
  uint64_t v = 0;
  const bool ok = SwarDigits(buf.data(), field.size(), &v);
  const auto want = LoopDigits(field);
  ASSERT_EQ(ok, want.has_value()) << ctx;
  if (ok) ASSERT_EQ(v, *want) << ctx;
  uint64_t m = 0;
  int frac = -1;
  const bool dok = SwarDecimal(buf.data(), field.size(), &m, &frac);
  const auto dwant = LoopDecimal(field);
  ASSERT_EQ(dok, dwant.has_value()) << ctx;
  if (dok) {
    ASSERT_EQ(m, dwant->first) << ctx;
    ASSERT_EQ(frac, dwant->second) << ctx;
  }
}

TEST(SwarDigits, ShortFieldsOfAwkwardBytesEqualTheLoops) {
  if (!kSwarDigits) GTEST_SKIP() << "big-endian: the word parse is not used";
  // Bytes around the digit range and the carries of the check: '/', ':', '.', 0x00, 0xFA, 0xFF.
  const std::string alphabet = std::string("0159./:- e\x00\xfa\xff\x39\x3a\x2f", 15);
  const std::vector<std::string> tails = {std::string(8, '0'), std::string(8, '\xff'),
                                          std::string(8, '\0'), ",24\n....."};
  for (size_t len = 1; len <= 3; ++len) {
    std::vector<size_t> idx(len, 0);
    while (true) {
      std::string f;
      for (size_t i : idx) f += alphabet[i];
      for (const auto& t : tails) Check(f, t);
      size_t k = 0;
      while (k < len && ++idx[k] == alphabet.size()) idx[k++] = 0;
      if (k == len) break;
    }
  }
}

TEST(SwarDigits, RandomFieldsUpToEightBytesEqualTheLoops) {
  if (!kSwarDigits) GTEST_SKIP() << "big-endian: the word parse is not used";
  std::mt19937_64 rng(std::random_device{}());
  for (int iter = 0; iter < 200000; ++iter) {
    const size_t len = 1 + rng() % 8;
    std::string f, tail;
    for (size_t i = 0; i < len; ++i) {
      const uint64_t r = rng() % 16;
      f += r < 12   ? static_cast<char>('0' + rng() % 10)
           : r < 14 ? '.'
                    : static_cast<char>(rng() % 256);
    }
    for (int i = 0; i < 8; ++i) tail += static_cast<char>(rng() % 256);
    Check(f, tail);
  }
  // Every value of up to 8 digits parses to itself (leading zeros too).
  for (uint64_t v : {0ull, 7ull, 10ull, 99ull, 12345678ull, 99999999ull, 10000000ull}) {
    const std::string s = std::to_string(v);
    uint64_t got = 0;
    ASSERT_TRUE(SwarDigits((s + "xxxxxxxx").data(), s.size(), &got));
    EXPECT_EQ(got, v);
  }
}

// FastValidateRow with and without the word parse: the same verdict and the same sample.
TEST(SwarDigits, FastValidateRowPaddedEqualsUnpadded) {
  std::mt19937_64 rng(5);
  const std::vector<std::string> nums = {"1", "81",  "081", "0",        "480",       "1280", "12a",
                                         "",  " 81", "1e2", "99999999", "123456789", "-1"};
  const std::vector<std::string> fps = {"",       "24",       "23.976", "29.97", "0.5",
                                        "24.",    ".5",       "1.2.3",  "0",     "1000001",
                                        "0.0001", "30.00000", "1e3",    " 24"};
  for (int iter = 0; iter < 20000; ++iter) {
    std::array<std::string, kNumRequired> text = {
        "v.mp4", nums[rng() % nums.size()], nums[rng() % nums.size()], nums[rng() % nums.size()],
        fps[rng() % fps.size()]};
    if (rng() % 4 == 0) text[kFrames] = "1";
    std::string buf;
    std::array<size_t, kNumRequired> at{};
    for (int k = 0; k < kNumRequired; ++k) {
      at[k] = buf.size();
      buf += text[k] + ",";
    }
    buf += std::string(16, '\xff');
    std::array<FieldRef, kNumRequired> f;
    for (int k = 0; k < kNumRequired; ++k) {
      f[k] = FieldRef{std::string_view(buf.data() + at[k], text[k].size()), 1, true, false};
    }
    RawSample a, b;
    const bool pa = FastValidateRow(f, &a, /*padded=*/true);
    const bool pb = FastValidateRow(f, &b, /*padded=*/false);
    const std::string ctx = text[1] + "," + text[2] + "," + text[3] + "," + text[4];
    ASSERT_EQ(pa, pb) << ctx;
    if (pa) {
      EXPECT_EQ(a.num_frames, b.num_frames) << ctx;
      EXPECT_EQ(a.height, b.height) << ctx;
      EXPECT_EQ(a.width, b.width) << ctx;
      EXPECT_EQ(std::memcmp(&a.fps, &b.fps, sizeof(float)), 0) << ctx;
    }
  }
}

}  // namespace
}  // namespace ditscale::balance::internal
