// Builds the model's weights from the canonical tensors of a checkpoint (names and shapes: the schema
// below, the contract with src/lily/checkpoint.py). Matrices stay where the checkpoint mapped them:
// each file is registered with the backend once and a Weight is a place in one. Routed experts become
// stacked weights; experts stored one tensor each (transformers' save_pretrained) that do not sit at a
// uniform stride are repacked once into one buffer per projection, and the load info says so.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/qwen36.h"

namespace lily {

// A matrix as the checkpoint layer hands it over: its format and host pointers into a mapped file.
struct HostMatrix {
  WeightFormat fmt;
  const void* data = nullptr;
  const void* scales = nullptr;
  const void* biases = nullptr;
};

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // Throws std::invalid_argument naming the tensor when it is missing or its shape or size is wrong.
  virtual HostMatrix matrix(const std::string& name, int64_t rows, int64_t cols) = 0;
  virtual const float* vector(const std::string& name, int64_t count) = 0;
};

struct LoadInfo {
  std::map<std::string, size_t> weight_bytes;  // per component of the decoder, as read from the checkpoint
  int64_t mappings = 0;                        // regions registered with the backend
  int64_t repacked_projections = 0;            // decoder expert projections copied into a stacked buffer
  size_t repacked_bytes = 0;
  // The MTP block (ModelConfig::mtp_layers > 0), counted apart: the graph does not read it yet.
  size_t mtp_bytes = 0;
  int64_t mtp_repacked_projections = 0;
  size_t mtp_repacked_bytes = 0;
  std::vector<std::unique_ptr<uint8_t[]>> owned;  // the repacked buffers (alive as long as the model)
};

struct MappedRegion {
  const void* base;
  size_t bytes;
  std::string label;
};

// Registers `files` (whole mapped checkpoint files) with the model's backend and loads every weight: the
// decoder's, and the MTP block's when config().mtp_layers > 0 (canonical names "mtp.fc",
// "mtp.pre_fc_norm_{embedding,hidden}", "mtp.norm", "mtp.layers.{j}.*" like "layers.{i}.*").
LoadInfo load_weights(Qwen36& model, WeightSource& src, const std::vector<MappedRegion>& files);

}  // namespace lily
