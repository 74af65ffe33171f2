// The vktrain delegate blob reader: header bounds, CRC-32s, the flatbuffers Verifier, then every check of
// vktrain/serialization/blob.py deserialize_blob and graph.py VkGraph.validate, in their order, with their
// messages. Every byte is hostile: nothing is read before the range holding it is checked.
#pragma once

#include <map>
#include <string>

#include "graph.h"

namespace vktrain {

using NamedData = std::map<std::string, Bytes>;

// Throws LoadError (kBlobFormat, kBlobChecksum) naming the field. `named_data` holds the .pte's named data
// (constants a blob refers to by key); null when the blob is read alone.
Graph read_blob(Bytes blob, const NamedData* named_data, bool verify_constants = true);

bool valid_utf8(const uint8_t* data, size_t size);

}  // namespace vktrain
