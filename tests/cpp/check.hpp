// A tiny test harness: TEST(name) registers a test; CHECK/CHECK_EQ record failures with file:line
// and keep going; main() runs every test and prints one closing line "N passed, N failed".
#pragma once

#include <cstdio>
#include <exception>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace check {
struct Test { const char* name; void (*fn)(); };
inline std::vector<Test>& registry() { static std::vector<Test> tests; return tests; }
inline int& failures() { static int n = 0; return n; }
struct Registrar { Registrar(const char* name, void (*fn)()) { registry().push_back({name, fn}); } };
inline void fail(const char* file, int line, const std::string& what) {
  ++failures();
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
}
template <typename T>
auto show(const T& v, int) -> decltype(std::declval<std::ostream&>() << v, std::string()) {
  std::ostringstream o;
  o << v;
  return o.str();
}
template <typename T>
std::string show(const T&, long) { return "<unprintable>"; }
}  // namespace check

#define TEST(name)                                                            \
  static void test_##name();                                                  \
  static const ::check::Registrar check_reg_##name(#name, &test_##name);      \
  static void test_##name()
#define CHECK(cond) \
  do { if (!(cond)) ::check::fail(__FILE__, __LINE__, #cond); } while (0)
#define CHECK_EQ(a, b)                                                                     \
  do {                                                                                     \
    const auto& check_a_ = (a);                                                            \
    const auto& check_b_ = (b);                                                            \
    if (!(check_a_ == check_b_))                                                           \
      ::check::fail(__FILE__, __LINE__, std::string(#a " == " #b " (") +                   \
                    ::check::show(check_a_, 0) + " vs " + ::check::show(check_b_, 0) + ")"); \
  } while (0)

int main() {
  int passed = 0, failed = 0;
  for (const auto& t : ::check::registry()) {
    const int before = ::check::failures();
    try {
      t.fn();
    } catch (const std::exception& e) {
      ::check::fail(__FILE__, __LINE__, std::string(t.name) + " threw: " + e.what());
    } catch (...) {
      ::check::fail(__FILE__, __LINE__, std::string(t.name) + " threw");
    }
    const bool ok = ::check::failures() == before;
    std::fprintf(stderr, "%s %s\n", ok ? "ok  " : "FAIL", t.name);
    (ok ? passed : failed)++;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
