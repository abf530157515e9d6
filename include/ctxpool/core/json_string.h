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

#include "absl/strings/str_format.h"
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
          absl::StrAppendFormat(&out, "\\u%04x", static_cast<unsigned char>(c));
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
