// Where a step's schedule and shader modules come from: one small interface, so the interpreter does not
// care whether they are files beside the .pte (today: a serialized schedule and a SPIR-V directory) or
// sections of the delegate blob (issue 25's embedding, when it lands: a second implementation of this).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "schedule.h"

namespace vktrain {

class StepSource {
 public:
  virtual ~StepSource() = default;
  virtual const Schedule& schedule() const = 0;
  // The SPIR-V words of shader variant `name` ("linear_q4gsw@GEMV"); LoadError kShaderModule naming what is
  // missing or malformed.
  virtual std::vector<uint32_t> module(const std::string& name) const = 0;
};

// The schedule file `schedule_path` (schedule.py serialize_schedule) and the modules of `spirv_dir`, named as
// vktrain/runtime_shaders/build.py names its cache: "<stem>.<hash>.spv" (or "<stem>.spv"), where the stem of
// "base@A+B=4" is "base.v.A.B-4".
std::unique_ptr<StepSource> files_step_source(const std::string& schedule_path, const std::string& spirv_dir);

// build.py ShaderVariant.file_stem of a shader name; LoadError kShaderModule for a malformed name.
std::string shader_file_stem(const std::string& name);

}  // namespace vktrain
