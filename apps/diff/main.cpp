// stepcore-diff: compares two recordings or two safetensors files bit for bit and says
// where they first diverge. Usage: stepcore-diff [--json] [--all] [--max-ulps N]
// [--threads N] A B (docs/diff.md).
#include <iostream>

#include "cli.hpp"

int main(int argc, char** argv) { return stepcore_diff::run(argc, argv, std::cout, std::cerr); }
