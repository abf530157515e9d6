// Runs a fuzz target over files, without libFuzzer: each argument is a file
// or a directory of files (the seed corpus and the inputs that once crashed,
// kept as regression tests). Built with any compiler, it makes the fuzz
// targets ordinary tests of the main build:
//
//   trace_reader_fuzzer tests/data/fuzz/trace_reader tests/data
//
// Prints how many inputs ran and exits non-zero when none could be read.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <system_error>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data,
                                      std::size_t size);

namespace {

bool RunFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::vector<char> bytes;
  in.seekg(0, std::ios::end);
  const std::streamoff n = in.tellg();
  if (n < 0) return false;
  bytes.resize(static_cast<std::size_t>(n));
  in.seekg(0);
  if (n > 0 && !in.read(bytes.data(), n)) return false;
  LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()),
                         bytes.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  int ran = 0;
  for (int i = 1; i < argc; ++i) {
    std::error_code ec;
    const std::filesystem::path arg(argv[i]);
    if (std::filesystem::is_directory(arg, ec)) {
      std::vector<std::filesystem::path> files;
      for (const auto& entry :
           std::filesystem::recursive_directory_iterator(arg, ec)) {
        if (entry.is_regular_file(ec)) files.push_back(entry.path());
      }
      std::sort(files.begin(), files.end());
      for (const auto& f : files) ran += RunFile(f) ? 1 : 0;
    } else if (RunFile(arg)) {
      ++ran;
    } else {
      std::fprintf(stderr, "%s: cannot read %s\n", argv[0], argv[i]);
      return 1;
    }
  }
  std::printf("%s: %d inputs ran\n", argv[0], ran);
  return ran > 0 ? 0 : 1;
}
