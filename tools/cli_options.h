// Numeric CLI options with a documented range, parsed strictly.
//
// AddNumber(cmd, "--seed", &seed, lo, hi, "Shuffle seed") registers an option whose text is
// parsed by this file, not by CLI11's converters, so that nothing is wrapped, clamped or
// defaulted silently:
//   - an integer option takes a plain decimal integer: "1.5", "1e3", "" and trailing text are
//     refused, and so is "-1" for an unsigned one (CLI11 would give 2^64-1);
//   - a real option takes a finite decimal number: "nan", "inf" and numbers beyond double
//     ("1e400", and "1e-50"'s underflow to 0 when the range excludes 0) are refused;
//   - the value must lie in [lo, hi]; otherwise the error reads
//       "--seed: -1 is out of range [0, 18446744073709551615]".
// Errors are CLI::ValidationError, printed by the CLI's top level with exit code 105-ish as
// every other parse error. The option's default is the variable's value before parsing.
#pragma once

#include <CLI/CLI.hpp>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "ditscale/core/range.h"

namespace ditscale::cli {

namespace internal {

template <typename T>
T ParseNumber(const std::string& name, const std::string& text, T lo, T hi) {
  const char* b = text.data();
  const char* e = b + text.size();
  auto bad = [&](const char* why) { return CLI::ValidationError(name, "'" + text + "' " + why); };
  if constexpr (std::is_integral_v<T>) {
    if (std::is_unsigned_v<T> && !text.empty() && text[0] == '-') {
      // "-0" is no more an unsigned number than "-1".
      throw CLI::ValidationError(
          name, text + " is out of range [" + FormatNumber(lo) + ", " + FormatNumber(hi) + "]");
    }
    using Wide = std::conditional_t<std::is_unsigned_v<T>, unsigned long long, long long>;
    Wide w{};
    if (!text.empty() && text[0] == '+') ++b;
    auto [p, ec] = std::from_chars(b, e, w);
    if (ec == std::errc::result_out_of_range) {
      throw CLI::ValidationError(
          name, text + " is out of range [" + FormatNumber(lo) + ", " + FormatNumber(hi) + "]");
    }
    if (ec != std::errc() || p != e || b == e) throw bad("is not an integer");
    if (auto err = RangeError(name, w, static_cast<Wide>(lo), static_cast<Wide>(hi))) {
      throw CLI::ValidationError(*err);
    }
    return static_cast<T>(w);
  } else {
    double v = 0;
    if (!text.empty() && text[0] == '+') ++b;
    auto [p, ec] = std::from_chars(b, e, v);
    if (ec == std::errc::result_out_of_range) {
      throw CLI::ValidationError(name, text + " is not representable as a double (range [" +
                                           FormatNumber(double(lo)) + ", " +
                                           FormatNumber(double(hi)) + "])");
    }
    if (ec != std::errc() || p != e || b == e) throw bad("is not a number");
    if (auto err = RangeError(name, v, static_cast<double>(lo), static_cast<double>(hi))) {
      throw CLI::ValidationError(*err);
    }
    return static_cast<T>(v);
  }
}

template <typename T>
std::string RangeText(T lo, T hi) {
  return "[" + FormatNumber(lo) + ", " + FormatNumber(hi) + "]";
}

}  // namespace internal

// A numeric option in [lo, hi]; see the file comment.
template <typename T>
CLI::Option* AddNumber(CLI::App* cmd, const std::string& name, T* var, T lo, T hi,
                       const std::string& desc) {
  static_assert(std::is_arithmetic_v<T>);
  CLI::Option* o = cmd->add_option_function<std::string>(
      name, [=](const std::string& s) { *var = internal::ParseNumber<T>(name, s, lo, hi); },
      desc + " " + internal::RangeText(lo, hi));
  o->type_name(std::is_integral_v<T> ? "INT" : "FLOAT");
  o->default_str(FormatNumber(*var));
  return o;
}

// A list option (each element in [lo, hi]), comma- or space-separated.
template <typename T>
CLI::Option* AddNumberList(CLI::App* cmd, const std::string& name, std::vector<T>* var, T lo, T hi,
                           const std::string& desc) {
  static_assert(std::is_arithmetic_v<T>);
  CLI::Option* o = cmd->add_option_function<std::vector<std::string>>(
      name,
      [=](const std::vector<std::string>& items) {
        var->clear();
        for (const auto& s : items) var->push_back(internal::ParseNumber<T>(name, s, lo, hi));
      },
      desc + " " + internal::RangeText(lo, hi));
  o->type_name(std::is_integral_v<T> ? "INT" : "FLOAT")->delimiter(',');
  return o;
}

}  // namespace ditscale::cli
