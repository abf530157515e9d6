// ctxpool/core/json_string.h — a JSON string literal from any bytes.
//
// Every JSON ctxpool writes (trace replays, snapshots, `ctxpool --json`
// output, the PyTorch plugin's stats) quotes strings through this one
// function, so escaping is the same everywhere:
//
//   JsonString("a\"b\n");   // "\"a\\\"b\\n\"" — quotes included
//
// Thread-safety: a pure function.
#ifndef CTXPOOL_CORE_JSON_STRING_H_
#define CTXPOOL_CORE_JSON_STRING_H_

#include <string>

#include "absl/strings/string_view.h"

namespace ctxpool {

// `value` as a JSON string literal, quotes included. Control characters are
// escaped (\n, \t, \r by name, the rest as \u00XX); other bytes pass through.
inline std::string JsonString(absl::string_view value) {
  std::string out;
  out.reserve(value.size() + 2);
  out.push_back('"');
  for (char c : value) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          // By hand: absl::StrAppendFormat flushes in a destructor, where a
          // std::bad_alloc cannot unwind (core/internal/format.h).
          constexpr char kHex[] = "0123456789abcdef";
          const auto u = static_cast<unsigned char>(c);
          const char escape[] = {'\\', 'u',          '0',
                                 '0',  kHex[u >> 4], kHex[u & 15]};
          out.append(escape, sizeof(escape));
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
  return out;
}

}  // namespace ctxpool

#endif  // CTXPOOL_CORE_JSON_STRING_H_
