// `vktrain train --out-adapters`'s PEFT adapter directory (vktrain/train/adapters.py save_adapters, the format
// of vktrain/serialization/peft_adapters.py), written from a native step's state: adapter_model.safetensors
// (base_model.model.<module>.lora_A.weight float32 [r, in] and .lora_B.weight [out, r], metadata
// {"format": "pt"}) and adapter_config.json (PEFT LoraConfig fields, json.dumps(indent=1)), the same bytes as
// the Python trainer writes for the same state.
#pragma once

#include <string>

#include "graph.h"
#include "interpreter.h"

namespace vktrain {

struct AdapterOptions {
  double lora_alpha = 0;    // 0: the program's recorded lora_alpha (metadata), which must then exist
  const char* base_model = nullptr;  // nullptr: the recorded base_model_name_or_path, else source_model, else null
};

// Writes both files (atomically) into `directory`, created with its parents. The adapters are the state's
// model.<module>.lora_A / .lora_B (and a --freeze-lora-a program's lora_A constants). LoadError naming
// `program` (the .pte as given) and what is wrong: no LoRA tensors, a module without both, shapes that are not
// [r, in] and [out, r], malformed recorded metadata, no lora_alpha anywhere, an unwritable directory.
void save_peft_adapters(const std::string& directory, const Graph& graph, const StepInterpreter& step,
                        const AdapterOptions& options, const std::string& program);

// The lora_alpha the program's metadata records (vktrain export), 0 when it records none; LoadError naming
// `program` when it is malformed.
double recorded_lora_alpha(const Graph& graph, const std::string& program);

// Python's repr of a float (json.dumps's numbers): "16.0", "0.0001", "1e-05", "1.5e+16".
std::string python_float_repr(double value);

}  // namespace vktrain
