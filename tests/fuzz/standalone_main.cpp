// A libFuzzer-compatible driver for compilers without libFuzzer (gcc): replays every file of the
// corpus directories given, then mutates corpus entries at random (bit flips, byte sets, inserts,
// deletes, splices, interesting integers) for -max_total_time seconds or -runs inputs, calling
// LLVMFuzzerTestOneInput on each. Build it with ASan+UBSan: a finding aborts with their report.
// Prints the executions and time on exit, as libFuzzer's "Done N runs in S second(s)".
#include <dirent.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size);

namespace {

constexpr std::size_t kMaxLen = 4096;

std::vector<std::string> load(const char* dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir);
  if (!d) {  // a single file
    std::ifstream f(dir, std::ios::binary);
    if (f) out.emplace_back((std::ostringstream() << f.rdbuf()).str());
    return out;
  }
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream f(std::string(dir) + "/" + e->d_name, std::ios::binary);
    out.emplace_back((std::ostringstream() << f.rdbuf()).str());
  }
  ::closedir(d);
  return out;
}

void mutate(std::string& s, const std::vector<std::string>& corpus, std::mt19937_64& rng) {
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < rounds; ++i) {
    const std::size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
    switch (rng() % 7) {
      case 0:
        if (!s.empty()) s[pos % s.size()] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:
        if (!s.empty()) s[pos % s.size()] = static_cast<char>(rng());
        break;
      case 2: s.insert(pos, 1 + rng() % 8, static_cast<char>(rng())); break;
      case 3:
        if (!s.empty()) s.erase(pos % s.size(), 1 + rng() % 8);
        break;
      case 4: {  // splice in part of another entry
        const std::string& o = corpus[rng() % corpus.size()];
        if (o.empty()) break;
        const std::size_t from = rng() % o.size();
        s.insert(pos, o, from, 1 + rng() % (o.size() - from));
        break;
      }
      case 5: {  // an interesting little-endian integer
        static const uint64_t kVals[] = {0, 1, 5, 0x7f, 0xff, 0x100, 0xffff, 0x7fffffff, 0xffffffff,
                                         0x800000, 0x800001, 0xffffffffffffffffull, 0x8000000000000000ull};
        const uint64_t v = kVals[rng() % (sizeof kVals / sizeof kVals[0])];
        const std::size_t width = (rng() % 2) ? 4 : 8;
        s.insert(pos, reinterpret_cast<const char*>(&v), width);
        break;
      }
      case 6:  // duplicate a chunk (repeated requests)
        if (!s.empty()) {
          const std::size_t from = rng() % s.size();
          s.insert(pos, s.substr(from, 1 + rng() % 64));
        }
        break;
    }
  }
  if (s.size() > kMaxLen) s.resize(kMaxLen);
}

}  // namespace

int main(int argc, char** argv) {
  double max_time = 10;
  long long max_runs = -1;
  uint64_t seed = 1;
  std::vector<std::string> corpus;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "-max_total_time=", 16) == 0) max_time = std::atof(argv[i] + 16);
    else if (std::strncmp(argv[i], "-runs=", 6) == 0) max_runs = std::atoll(argv[i] + 6);
    else if (std::strncmp(argv[i], "-seed=", 6) == 0) seed = std::strtoull(argv[i] + 6, nullptr, 10);
    else if (argv[i][0] == '-') continue;  // other libFuzzer flags: ignored
    else for (auto& s : load(argv[i])) corpus.push_back(std::move(s));
  }
  if (corpus.empty()) corpus.emplace_back();
  const auto t0 = std::chrono::steady_clock::now();
  long long runs = 0;
  for (const auto& s : corpus) {
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
    ++runs;
  }
  std::mt19937_64 rng(seed);
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  while ((max_runs < 0 || runs < max_runs) && elapsed() < max_time) {
    std::string s = corpus[rng() % corpus.size()];
    mutate(s, corpus, rng);
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
    ++runs;
  }
  std::printf("Done %lld runs in %.0f second(s) (standalone driver, %zu corpus inputs)\n", runs,
              elapsed(), corpus.size());
  return 0;
}
