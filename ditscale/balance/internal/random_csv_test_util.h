// Test helper (header only, for the reader tests): random CSV manifests, well-formed or hostile.
#pragma once

#include <random>
#include <string>

namespace ditscale::balance::internal {

// A random manifest; `hostile` mixes in every kind of bad row and awkward quoting.
// `plain`: unquoted captions without line breaks (the records the one-pass fast path takes).
inline std::string RandomCsv(std::mt19937_64& rng, int rows, bool hostile, bool plain = false) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  std::string s = pick(4) == 0 ? "\xEF\xBB\xBF" : "";
  s += "path,text,num_frames,height,width,fps,extra\n";
  const char* fps[] = {"24", "23.976", "29.97", "30", "60", "", "0.5", "25.000000001"};
  for (int r = 0; r < rows; ++r) {
    const bool image = pick(3) == 0;
    std::string caption = "\"a ";
    for (int w = pick(6); w >= 0; --w) {
      const int k = pick(10);
      caption += k == 0   ? "\"\"quoted\"\" "
                 : k == 1 ? ", comma "
                 : k == 2 ? "line\nbreak "
                          : "word ";
    }
    caption += "\"";
    if (plain) caption = std::string(static_cast<size_t>(pick(40)), 'w');
    std::string row = "v" + std::to_string(r) + ".mp4," + caption + "," +
                      (image ? "1" : std::to_string(1 + pick(400))) + "," +
                      std::to_string(16 + pick(1500)) + "," + std::to_string(16 + pick(2000)) +
                      "," + (image ? "" : fps[pick(5)]) + ",x";
    if (hostile) {
      switch (pick(40)) {
        case 0:
          row = "bad.mp4,\"c\",12abc,480,832,24,x";
          break;
        case 1:
          row = "bad.mp4,\"c\",81,480,832,,x";
          break;
        case 2:
          row = "bad.mp4,\"c\",81,480";
          break;
        case 3:
          row = "bad.mp4,\"c\"x,81,480,832,24,x";
          break;
        case 4:
          row = "ab\"c.mp4,caption,81,480,832,24,x";
          break;  // a quote in an unquoted field
        case 5:
          row = "q.mp4,\"c\",81,480,832,\"" + std::string(fps[pick(8)]) + "\",x,y";
          break;
        case 6:
          row += "\r";
          break;  // CRLF
        case 7:
          s += "\n";
          break;  // a blank line
        case 8:
          row += "\r\r";
          break;  // a lone '\r' ends the row too
        case 9:
          row = "z.mp4,\"c\",-3,0,nan,24,x";
          break;
        case 10:
          row = "p.mp4,c,2,16,16," + std::string(fps[pick(8)]) + ",x";
          break;
        default:
          break;
      }
    }
    s += row;
    s += "\n";
  }
  if (hostile && pick(4) == 0) s += "tail.mp4,\"unterminated,81,480,832,24,x\n";
  if (pick(2) == 0 && !s.empty()) s.pop_back();  // no final newline
  return s;
}

}  // namespace ditscale::balance::internal
