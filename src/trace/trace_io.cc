#include "ctxpool/trace/trace_io.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "ctxpool/core/internal/format.h"
#include "ctxpool/status.h"

namespace ctxpool {
namespace {

// ---- Scalars -------------------------------------------------------------

// Parses a whole decimal or 0x-prefixed hex unsigned integer.
bool ParseU64(absl::string_view s, std::uint64_t* out) {
  int base = 10;
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    s.remove_prefix(2);
    base = 16;
  }
  if (s.empty()) return false;
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, *out, base);
  return ec == std::errc() && p == end;
}

// Parses "HH:MM:SS[.fraction]" into nanoseconds.
bool ParseClockTime(absl::string_view s, std::int64_t* ns) {
  std::vector<absl::string_view> parts = absl::StrSplit(s, ':');
  if (parts.size() != 3) return false;
  std::uint64_t h = 0, m = 0, sec = 0, frac = 0;
  absl::string_view sec_part = parts[2];
  absl::string_view frac_part;
  if (std::size_t dot = sec_part.find('.'); dot != absl::string_view::npos) {
    frac_part = sec_part.substr(dot + 1);
    sec_part = sec_part.substr(0, dot);
  }
  if (!ParseU64(parts[0], &h) || !ParseU64(parts[1], &m) ||
      !ParseU64(sec_part, &sec) || parts[0].substr(0, 2) == "0x") {
    return false;
  }
  int digits = 0;
  for (char c : frac_part) {
    if (c < '0' || c > '9') return false;
    if (digits < 9) {
      frac = frac * 10 + static_cast<std::uint64_t>(c - '0');
      ++digits;
    }
  }
  for (; digits < 9; ++digits) frac *= 10;
  // Every time that fits an int64 of nanoseconds (up to 2562047:47:16.85...)
  // reads back, so whatever FormatClockTime writes parses again.
  constexpr std::uint64_t kMaxNs = static_cast<std::uint64_t>(INT64_MAX);
  constexpr std::uint64_t kMaxSeconds = kMaxNs / 1'000'000'000;
  if (m >= 60 || sec > 60 || h > kMaxSeconds / 3600) return false;
  const std::uint64_t seconds = (h * 60 + m) * 60 + sec;
  if (seconds > kMaxSeconds) return false;
  const std::uint64_t total = seconds * 1'000'000'000 + frac;
  if (total > kMaxNs) return false;
  *ns = static_cast<std::int64_t>(total);
  return true;
}

std::string FormatClockTime(std::int64_t ns) {
  if (ns < 0) ns = 0;
  const std::int64_t total_s = ns / 1'000'000'000;
  return core_internal::Format("%02d:%02d:%02d.%09d", total_s / 3600,
                               (total_s / 60) % 60, total_s % 60,
                               ns % 1'000'000'000);
}

// ---- Validation with line numbers ----------------------------------------

class Builder {
 public:
  Builder(absl::string_view name, UnknownFreePolicy policy)
      : name_(name), policy_(policy) {}

  absl::Status Error(int line, absl::string_view message) const {
    return absl::InvalidArgumentError(
        absl::StrCat(name_, ":", line, ": ", message));
  }

  absl::Status Add(const TraceEvent& e, int line) {
    if (e.op == TraceOp::kAlloc) {
      if (policy_ == UnknownFreePolicy::kSynthesizeAlloc) ever_.insert(e.ptr);
      if (!live_.emplace(e.ptr, e.size).second) {
        return Error(line,
                     core_internal::Format(
                         "allocation of pointer 0x%x, which is live", e.ptr));
      }
    } else if (e.op == TraceOp::kFree) {
      auto it = live_.find(e.ptr);
      if (it == live_.end()) {
        switch (policy_) {
          case UnknownFreePolicy::kError:
            return Error(line, core_internal::Format(
                                   "free of unknown pointer 0x%x", e.ptr));
          case UnknownFreePolicy::kIgnore:
            return absl::OkStatus();
          case UnknownFreePolicy::kSynthesizeAlloc: {
            // Only a pointer never seen before can have been live since
            // before the trace started; anything else is a double free.
            if (!synthesized_.insert(e.ptr).second || ever_.contains(e.ptr)) {
              return Error(line, core_internal::Format(
                                     "free of pointer 0x%x, which is not live "
                                     "(double free)",
                                     e.ptr));
            }
            TraceEvent a = e;
            a.op = TraceOp::kAlloc;
            prefix_.push_back(a);
            events_.push_back(e);
            return absl::OkStatus();
          }
        }
        return absl::OkStatus();
      }
      if (e.size != 0 && e.size != it->second) {
        return Error(
            line, core_internal::Format("free of 0x%x with size %d, allocated "
                                        "with size %d",
                                        e.ptr, e.size, it->second));
      }
      live_.erase(it);
    }
    events_.push_back(e);
    return absl::OkStatus();
  }

  Trace Finish(std::string source) && {
    std::vector<TraceEvent> all;
    if (!prefix_.empty()) {
      const std::int64_t t0 = events_.empty() ? 0 : events_.front().time_ns;
      for (TraceEvent& a : prefix_) a.time_ns = t0;
      all.reserve(prefix_.size() + events_.size());
      all.insert(all.end(), prefix_.begin(), prefix_.end());
      all.insert(all.end(), events_.begin(), events_.end());
    } else {
      all = std::move(events_);
    }
    Trace t(std::move(all));
    t.set_source(std::move(source));
    return t;
  }

  void Reserve(std::size_t n) { events_.reserve(n); }

 private:
  std::string name_;
  UnknownFreePolicy policy_;
  absl::flat_hash_map<std::uint64_t, std::uint64_t> live_;
  absl::flat_hash_set<std::uint64_t> ever_;         // kSynthesizeAlloc only
  absl::flat_hash_set<std::uint64_t> synthesized_;  // kSynthesizeAlloc only
  std::vector<TraceEvent> prefix_;
  std::vector<TraceEvent> events_;
};

absl::Status ParseSize(const Builder& b, int line, absl::string_view s,
                       std::uint64_t* size) {
  if (!s.empty() && s[0] == '-') {
    return b.Error(line, absl::StrCat("negative size ", s));
  }
  if (!ParseU64(s, size)) {
    return b.Error(line, absl::StrCat("bad size '", s, "'"));
  }
  return absl::OkStatus();
}

// ---- CSV -----------------------------------------------------------------

absl::StatusOr<Trace> ParseCsv(absl::string_view text, absl::string_view name,
                               const TraceReadOptions& options) {
  Builder b(name, options.unknown_free);
  enum Col { kThread, kTime, kAction, kPointer, kSize, kStream, kTenant, kN };
  static constexpr absl::string_view kNames[kN] = {
      "thread", "time", "action", "pointer", "size", "stream", "tenant"};
  int col[kN];
  for (int& c : col) c = -1;
  std::size_t num_fields = 0;
  bool have_header = false;
  int line_no = 0;
  std::size_t index = 0;
  b.Reserve(
      static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n') + 1));
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields = absl::StrSplit(line, ',');
    for (absl::string_view& f : fields) f = absl::StripAsciiWhitespace(f);
    if (!have_header) {
      have_header = true;
      num_fields = fields.size();
      for (std::size_t i = 0; i < fields.size(); ++i) {
        const std::string lower = absl::AsciiStrToLower(fields[i]);
        for (int c = 0; c < kN; ++c) {
          if (lower == kNames[c]) col[c] = static_cast<int>(i);
        }
      }
      for (int c : {kAction, kPointer, kSize}) {
        if (col[c] < 0) {
          std::string want(kNames[c]);
          want[0] = absl::ascii_toupper(want[0]);
          return b.Error(
              line_no, absl::StrCat("missing column ", want, " (header: ", line,
                                    "; want at least Action,Pointer,"
                                    "Size, as in RMM's Thread,Time,"
                                    "Action,Pointer,Size,Stream)"));
        }
      }
      continue;
    }
    if (fields.size() != num_fields) {
      return b.Error(line_no,
                     core_internal::Format("expected %d fields, found %d",
                                           num_fields, fields.size()));
    }
    TraceEvent e;
    const absl::string_view action = fields[col[kAction]];
    std::optional<TraceOp> op = ParseTraceOp(action);
    if (!op)
      return b.Error(line_no, absl::StrCat("unknown action '", action, "'"));
    e.op = *op;
    if (!ParseU64(fields[col[kPointer]], &e.ptr)) {
      return b.Error(line_no,
                     absl::StrCat("bad pointer '", fields[col[kPointer]], "'"));
    }
    CTXPOOL_RETURN_IF_ERROR(ParseSize(b, line_no, fields[col[kSize]], &e.size));
    if (col[kTime] >= 0) {
      if (!ParseClockTime(fields[col[kTime]], &e.time_ns)) {
        return b.Error(line_no, absl::StrCat("bad time '", fields[col[kTime]],
                                             "' (want HH:MM:SS.ffffff)"));
      }
    } else {
      e.time_ns = static_cast<std::int64_t>(index) * 1000;
    }
    if (col[kStream] >= 0 && !ParseU64(fields[col[kStream]], &e.stream)) {
      return b.Error(line_no,
                     absl::StrCat("bad stream '", fields[col[kStream]], "'"));
    }
    if (col[kTenant] >= 0) {
      std::uint64_t tenant = 0;
      if (!ParseU64(fields[col[kTenant]], &tenant) || tenant > UINT32_MAX) {
        return b.Error(line_no,
                       absl::StrCat("bad tenant '", fields[col[kTenant]], "'"));
      }
      e.tenant = static_cast<std::uint32_t>(tenant);
    }
    if (col[kThread] >= 0 && !ParseU64(fields[col[kThread]], &e.thread)) {
      e.thread = 0;  // informational: RMM may print any thread id form
    }
    CTXPOOL_RETURN_IF_ERROR(b.Add(e, line_no));
    ++index;
  }
  if (!have_header) return b.Error(line_no, "empty trace: no header line");
  return std::move(b).Finish(std::string(name));
}

// ---- JSON ----------------------------------------------------------------

// A minimal JSON scanner for the trace form: it keeps line numbers and reads
// scalars as raw tokens so 64-bit integers stay exact.
class JsonScanner {
 public:
  JsonScanner(absl::string_view text, const Builder& b) : s_(text), b_(b) {}

  int line() const { return line_; }

  void SkipWs() {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == '\n') {
        ++line_;
      } else if (c != ' ' && c != '\t' && c != '\r') {
        break;
      }
      ++pos_;
    }
  }
  char Peek() {
    SkipWs();
    return pos_ < s_.size() ? s_[pos_] : '\0';
  }
  absl::Status Expect(char c) {
    if (Peek() != c) {
      return b_.Error(line_, core_internal::Format(
                                 "JSON: expected '%c', found %s", c, Found()));
    }
    ++pos_;
    return absl::OkStatus();
  }
  bool Consume(char c) {
    if (Peek() != c) return false;
    ++pos_;
    return true;
  }
  std::string Found() {
    if (pos_ >= s_.size()) return "end of input";
    return absl::StrCat("'", s_.substr(pos_, 10), "'");
  }

  absl::StatusOr<std::string> String() {
    CTXPOOL_RETURN_IF_ERROR(Expect('"'));
    std::string out;
    while (pos_ < s_.size() && s_[pos_] != '"') {
      char c = s_[pos_++];
      if (c == '\n') return b_.Error(line_, "JSON: newline in string");
      if (c == '\\') {
        if (pos_ >= s_.size()) break;
        c = s_[pos_++];
        switch (c) {
          case 'n':
            c = '\n';
            break;
          case 't':
            c = '\t';
            break;
          case 'r':
            c = '\r';
            break;
          case 'b':
            c = '\b';
            break;
          case 'f':
            c = '\f';
            break;
          case 'u': {
            // Keep \u escapes of ASCII; others become '?' (names only).
            std::uint64_t cp = 0;
            if (pos_ + 4 > s_.size() ||
                std::from_chars(s_.data() + pos_, s_.data() + pos_ + 4, cp, 16)
                        .ptr != s_.data() + pos_ + 4) {
              return b_.Error(line_, "JSON: bad \\u escape");
            }
            pos_ += 4;
            c = cp < 0x80 ? static_cast<char>(cp) : '?';
            break;
          }
          default:
            break;  // \" \\ \/
        }
      }
      out.push_back(c);
    }
    if (pos_ >= s_.size()) return b_.Error(line_, "JSON: unterminated string");
    ++pos_;
    return out;
  }

  // A number, true, false or null, as its raw text.
  absl::StatusOr<absl::string_view> Token() {
    SkipWs();
    const std::size_t start = pos_;
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || c == '-' ||
          c == '+' || c == '.' || (c >= 'A' && c <= 'Z')) {
        ++pos_;
      } else {
        break;
      }
    }
    if (pos_ == start) {
      return b_.Error(line_, absl::StrCat("JSON: unexpected ", Found()));
    }
    return s_.substr(start, pos_ - start);
  }

  // A scalar as text: strings unquoted, numbers raw. Sets *is_string.
  absl::StatusOr<std::string> Scalar(bool* is_string) {
    if (Peek() == '"') {
      *is_string = true;
      return String();
    }
    *is_string = false;
    if (Peek() == '{' || Peek() == '[') {
      return b_.Error(line_, "JSON: expected a number or string");
    }
    CTXPOOL_ASSIGN_OR_RETURN(absl::string_view t, Token());
    return std::string(t);
  }

  absl::Status SkipValue(int depth = 0) {
    if (depth > 64) return b_.Error(line_, "JSON: nested too deep");
    const char c = Peek();
    if (c == '"') return String().status();
    if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++pos_;
      if (Consume(close)) return absl::OkStatus();
      do {
        if (c == '{') {
          CTXPOOL_RETURN_IF_ERROR(String().status());
          CTXPOOL_RETURN_IF_ERROR(Expect(':'));
        }
        CTXPOOL_RETURN_IF_ERROR(SkipValue(depth + 1));
      } while (Consume(','));
      return Expect(close);
    }
    return Token().status();
  }

  bool AtEnd() { return Peek() == '\0' && pos_ >= s_.size(); }

 private:
  absl::string_view s_;
  const Builder& b_;
  std::size_t pos_ = 0;
  int line_ = 1;
};

absl::Status ParseJsonEvent(JsonScanner& js, Builder& b, std::size_t index) {
  js.Peek();  // skip to the event's first character
  const int line = js.line();
  TraceEvent e;
  e.time_ns = static_cast<std::int64_t>(index);
  bool has_op = false, has_ptr = false, has_size = false;
  CTXPOOL_RETURN_IF_ERROR(js.Expect('{'));
  if (!js.Consume('}')) {
    do {
      CTXPOOL_ASSIGN_OR_RETURN(std::string key, js.String());
      CTXPOOL_RETURN_IF_ERROR(js.Expect(':'));
      const bool known = key == "op" || key == "ptr" || key == "size" ||
                         key == "stream" || key == "tenant" ||
                         key == "thread" || key == "time_ns";
      if (!known) {
        CTXPOOL_RETURN_IF_ERROR(js.SkipValue());
        continue;
      }
      bool is_string = false;
      CTXPOOL_ASSIGN_OR_RETURN(std::string v, js.Scalar(&is_string));
      if (key == "op") {
        std::optional<TraceOp> op = ParseTraceOp(v);
        if (!op) return b.Error(line, absl::StrCat("unknown op '", v, "'"));
        e.op = *op;
        has_op = true;
      } else if (key == "size") {
        CTXPOOL_RETURN_IF_ERROR(ParseSize(b, line, v, &e.size));
        has_size = true;
      } else if (key == "time_ns") {
        std::uint64_t t = 0;
        if (!ParseU64(v, &t) || t > static_cast<std::uint64_t>(INT64_MAX)) {
          return b.Error(line, absl::StrCat("bad time_ns '", v, "'"));
        }
        e.time_ns = static_cast<std::int64_t>(t);
      } else {
        std::uint64_t x = 0;
        if (!ParseU64(v, &x)) {
          return b.Error(line, absl::StrCat("bad ", key, " '", v, "'"));
        }
        if (key == "ptr") {
          e.ptr = x;
          has_ptr = true;
        } else if (key == "stream") {
          e.stream = x;
        } else if (key == "thread") {
          e.thread = x;
        } else {
          if (x > UINT32_MAX) {
            return b.Error(line, absl::StrCat("bad tenant '", v, "'"));
          }
          e.tenant = static_cast<std::uint32_t>(x);
        }
      }
    } while (js.Consume(','));
    CTXPOOL_RETURN_IF_ERROR(js.Expect('}'));
  }
  if (!has_op || !has_ptr || !has_size) {
    return b.Error(line, absl::StrCat("event is missing \"",
                                      !has_op    ? "op"
                                      : !has_ptr ? "ptr"
                                                 : "size",
                                      "\""));
  }
  return b.Add(e, line);
}

absl::StatusOr<Trace> ParseJson(absl::string_view text, absl::string_view name,
                                const TraceReadOptions& options) {
  Builder b(name, options.unknown_free);
  JsonScanner js(text, b);
  std::string source(name);
  bool has_events = false, has_format = false;
  CTXPOOL_RETURN_IF_ERROR(js.Expect('{'));
  if (!js.Consume('}')) {
    do {
      CTXPOOL_ASSIGN_OR_RETURN(std::string key, js.String());
      CTXPOOL_RETURN_IF_ERROR(js.Expect(':'));
      bool is_string = false;
      if (key == "format") {
        CTXPOOL_ASSIGN_OR_RETURN(std::string v, js.Scalar(&is_string));
        if (v != "ctxpool-trace") {
          return b.Error(js.line(), absl::StrCat("format is '", v,
                                                 "', want 'ctxpool-trace'"));
        }
        has_format = true;
      } else if (key == "version") {
        CTXPOOL_ASSIGN_OR_RETURN(std::string v, js.Scalar(&is_string));
        if (v != "1") {
          return b.Error(js.line(),
                         absl::StrCat("unsupported version ", v, " (want 1)"));
        }
      } else if (key == "source") {
        CTXPOOL_ASSIGN_OR_RETURN(source, js.Scalar(&is_string));
      } else if (key == "events") {
        has_events = true;
        CTXPOOL_RETURN_IF_ERROR(js.Expect('['));
        std::size_t index = 0;
        if (!js.Consume(']')) {
          do {
            CTXPOOL_RETURN_IF_ERROR(ParseJsonEvent(js, b, index++));
          } while (js.Consume(','));
          CTXPOOL_RETURN_IF_ERROR(js.Expect(']'));
        }
      } else {
        CTXPOOL_RETURN_IF_ERROR(js.SkipValue());
      }
    } while (js.Consume(','));
    CTXPOOL_RETURN_IF_ERROR(js.Expect('}'));
  }
  if (!js.AtEnd()) {
    return b.Error(js.line(), "JSON: trailing text after the trace object");
  }
  if (!has_format) {
    return b.Error(1, "missing \"format\": \"ctxpool-trace\"");
  }
  if (!has_events) return b.Error(js.line(), "missing \"events\" array");
  return std::move(b).Finish(std::move(source));
}

}  // namespace

absl::StatusOr<Trace> ParseTrace(absl::string_view text, absl::string_view name,
                                 const TraceReadOptions& options) {
  TraceFormat format = options.format;
  if (format == TraceFormat::kAuto) {
    absl::string_view t = absl::StripLeadingAsciiWhitespace(text);
    format =
        (!t.empty() && t[0] == '{') ? TraceFormat::kJson : TraceFormat::kCsv;
  }
  if (format == TraceFormat::kJson) return ParseJson(text, name, options);
  return ParseCsv(text, name, options);
}

absl::StatusOr<Trace> ReadTraceFile(const std::string& path,
                                    const TraceReadOptions& options) {
  // stdio, not iostreams: reading a directory (or any read error) must come
  // back as a Status, and libstdc++'s streambuf throws on EISDIR.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is a directory, not a trace file"));
  }
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  std::string text;
  char buf[1 << 16];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) {
    return absl::DataLossError(
        absl::StrCat("cannot read ", path, ": ", std::strerror(err)));
  }
  // A pickle (protocol 2+ starts with 0x80): most likely a PyTorch memory
  // snapshot, which the tools read once converted.
  if (!text.empty() && static_cast<unsigned char>(text[0]) == 0x80) {
    return absl::InvalidArgumentError(absl::StrCat(
        path,
        " is a Python pickle (a PyTorch memory snapshot?), not a trace: "
        "convert it with tools/torch_snapshot_to_trace.py"));
  }
  return ParseTrace(text, path, options);
}

std::string WriteTraceCsv(const Trace& trace, const TraceCsvOptions& options) {
  std::string out = options.rmm_compatible
                        ? "Thread,Time,Action,Pointer,Size,Stream\n"
                        : "Thread,Time,Action,Pointer,Size,Stream,Tenant\n";
  out.reserve(out.size() + trace.size() * 64);
  for (const TraceEvent& e : trace.events()) {
    if (options.rmm_compatible && e.op != TraceOp::kAlloc &&
        e.op != TraceOp::kFree && e.op != TraceOp::kOom) {
      continue;
    }
    core_internal::AppendFormat(&out, "%d,%s,%s,0x%x,%d,0x%x", e.thread,
                                FormatClockTime(e.time_ns), TraceOpName(e.op),
                                e.ptr, e.size, e.stream);
    if (!options.rmm_compatible) absl::StrAppend(&out, ",", e.tenant);
    out.push_back('\n');
  }
  return out;
}

std::string WriteTraceJson(const Trace& trace) {
  std::string source;
  for (char c : trace.source()) {
    if (c == '"' || c == '\\') source.push_back('\\');
    if (static_cast<unsigned char>(c) >= 0x20) source.push_back(c);
  }
  std::string out = absl::StrCat(
      "{\"format\": \"ctxpool-trace\", \"version\": 1, \"source\": \"", source,
      "\",\n \"events\": [");
  bool first = true;
  for (const TraceEvent& e : trace.events()) {
    core_internal::AppendFormat(
        &out,
        "%s\n  {\"time_ns\": %d, \"op\": \"%s\", \"ptr\": %d, \"size\": %d, "
        "\"stream\": %d, \"tenant\": %d, \"thread\": %d}",
        first ? "" : ",", e.time_ns, TraceOpName(e.op), e.ptr, e.size, e.stream,
        e.tenant, e.thread);
    first = false;
  }
  out += "\n]}\n";
  return out;
}

absl::Status WriteFile(const std::string& path, absl::string_view contents) {
  // stdio, not std::ofstream: the stream's buffer comes from operator new
  // after the file is truncated, so a std::bad_alloc there would leave the
  // old file empty; stdio allocates nothing through operator new.
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  const bool wrote =
      std::fwrite(contents.data(), 1, contents.size(), f) == contents.size();
  const bool closed = std::fclose(f) == 0;
  if (!wrote || !closed) {
    return absl::InternalError(absl::StrCat("cannot write ", path));
  }
  return absl::OkStatus();
}

}  // namespace ctxpool
