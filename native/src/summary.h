// What `vktrain-native-inspect` prints about a verified program: per method its instructions and, for the
// vktrain delegate, ops, constants, planned memory, state and I/O (the fields of `vktrain inspect --json`
// of the same names: vktrain/runtime/program/summary.py).
#pragma once

#include <string>

#include "pte.h"

namespace vktrain {

std::string summary_json(const Program& program);
std::string summary_text(const Program& program);

}  // namespace vktrain
