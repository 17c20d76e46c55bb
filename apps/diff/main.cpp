// stepcore-diff: compares two recordings or two safetensors files bit for bit and says
// where they first diverge. Usage: stepcore-diff [--json] [--all] [--max-ulps N]
// [--threads N] A B (docs/diff.md). The comparer is the library's (diff/).
#include <iostream>

#include "stepcore/diff.hpp"

int main(int argc, char** argv) { return stepcore::diff::run(argc, argv, std::cout, std::cerr); }
