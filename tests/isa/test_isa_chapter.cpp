// Checks what the compiler made of one tensor-core chapter (label `isa`; needs nvcc only, so it
// runs in CI): the PTX holds the instructions the chapter is about, ptxas reports no spills and
// no stack frame for any of its kernels, and, where cuobjdump exists, the SASS holds the matching
// machine instructions and no local-memory accesses. CMake passes ISA_OUT (the path prefix of the
// files compile_isa.cmake wrote), ISA_PTX and ISA_SASS (','-separated instructions to find), and
// ISA_PTX_ABSENT (instructions that must not be there: atomics a chapter does not use).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::string read_file(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> items;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) items.push_back(item);
  return items;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("the PTX holds the chapter's instructions") {
  const std::string ptx = read_file(std::string(ISA_OUT) + ".ptx");
  REQUIRE_MESSAGE(!ptx.empty(), "no PTX at " ISA_OUT ".ptx");
  for (const std::string& instruction : split(ISA_PTX)) {
    INFO("PTX instruction: " << instruction);
    CHECK(count(ptx, instruction) > 0);
  }
}

TEST_CASE("the PTX holds none of the instructions the chapter does without") {
  const std::string ptx = read_file(std::string(ISA_OUT) + ".ptx");
  REQUIRE_MESSAGE(!ptx.empty(), "no PTX at " ISA_OUT ".ptx");
  for (const std::string& instruction : split(ISA_PTX_ABSENT)) {
    INFO("PTX instruction that should be absent: " << instruction);
    CHECK(count(ptx, instruction) == 0);
  }
}

TEST_CASE("ptxas reports no spills and no stack frame for any kernel") {
  const std::string report = read_file(std::string(ISA_OUT) + ".ptxas.txt");
  // One block per kernel: "Function properties for <name>\n    N bytes stack frame, N bytes spill
  // stores, N bytes spill loads\n ... Used N registers".
  const std::regex block(
      R"(Function properties for (\S+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads[^\n]*\n[^\n]*Used (\d+) registers)");
  size_t kernels = 0;
  for (std::sregex_iterator it(report.begin(), report.end(), block), end; it != end; ++it) {
    const std::smatch& m = *it;
    ++kernels;
    INFO("kernel " << m[1] << ": " << m[5] << " registers");
    CHECK(m[2] == "0");
    CHECK(m[3] == "0");
    CHECK(m[4] == "0");
    MESSAGE(m[1] << ": " << m[5] << " registers, 0 spills");
  }
  CHECK_MESSAGE(kernels >= 2, "expected a kernel per head_dim in " ISA_OUT ".ptxas.txt");
}

TEST_CASE("ptxas did not serialize wgmma") {
  // Warnings C7510-C7515 (and the C7517/C7519 notices of an injected wait or arrive) mean that
  // ptxas could not keep the wgmma pipeline asynchronous: correct, but slow (HOPPER notes).
  const std::string report = read_file(std::string(ISA_OUT) + ".ptxas.txt");
  for (const char* code :
       {"C7510", "C7511", "C7512", "C7513", "C7514", "C7515", "C7517", "C7519"}) {
    INFO("ptxas message " << code);
    CHECK(count(report, code) == 0);
  }
}

TEST_CASE("the SASS holds the matching machine instructions and no local memory") {
  const std::string sass = read_file(std::string(ISA_OUT) + ".sass");
  REQUIRE_MESSAGE(!sass.empty(), "no SASS at " ISA_OUT ".sass");
  for (const std::string& instruction : split(ISA_SASS)) {
    INFO("SASS instruction: " << instruction);
    CHECK(count(sass, instruction) > 0);
  }
  CHECK(count(sass, "LDL") == 0);
  CHECK(count(sass, "STL") == 0);
}

// Two CTest tests run this program: isa.NN (PTX and ptxas) and isa.NN.sass (`--sass`: the SASS
// alone), which reports itself as skipped (exit 77) when cuobjdump was not there to write it, so
// that a machine without cuobjdump never counts an unchecked SASS as a pass.
int main(int argc, char** argv) {
  bool sass = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--sass") == 0) sass = true;
    else args.push_back(argv[i]);
  }
  doctest::Context context(int(args.size()), args.data());
  if (sass && !context.shouldExit() && read_file(std::string(ISA_OUT) + ".sass").empty()) {
    std::printf(
        "SKIPPED: cuobjdump was not found when this test was built, so the SASS was not "
        "checked (build on a machine with the full CUDA Toolkit to check it)\n");
    return 77;
  }
  context.setOption(sass ? "test-case" : "test-case-exclude", "*SASS*");
  return context.run();
}
