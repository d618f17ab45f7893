// Metal device context for the Metal backend: one MTL::Device, one command queue, the library compiled from
// Lily's MSL sources (metal/*.metal), a cache of compute pipelines keyed by kernel name and function-constant
// values, and Pass: one command buffer with one concurrent compute encoder whose dispatches are separated into
// stages by memory barriers. Written against metal-cpp; on Linux it compiles against metal-cpp plus stub system
// headers and runs on the fake Metal runtime of tools/metalsim (docs/METAL_VERIFICATION.md).
#pragma once
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace lily::metal {

// Raised for any Metal failure: device missing, MSL compile error, unknown kernel, failed command buffer.
class MetalError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Holds one reference to a metal-cpp object and releases it when dropped (metal-cpp objects are refcounted).
template <class T>
class Ref {
 public:
  Ref() = default;
  explicit Ref(T* owned) : p_(owned) {}
  Ref(const Ref& o) : p_(o.p_) {
    if (p_) p_->retain();
  }
  Ref(Ref&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  Ref& operator=(Ref o) noexcept {
    T* t = p_;
    p_ = o.p_;
    o.p_ = t;
    return *this;
  }
  ~Ref() {
    if (p_) p_->release();
  }
  T* get() const { return p_; }
  T* operator->() const { return p_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  T* p_ = nullptr;
};

// A function-constant value for specialising a pipeline ([[function_constant(index)]] in MSL).
struct FunctionConstant {
  enum class Type : uint8_t { Bool, Int, UInt, Float };
  int index = 0;
  Type type = Type::UInt;
  uint32_t bits = 0;  // the value's bytes (bool: 0/1)

  static FunctionConstant u32(int index, uint32_t v) { return {index, Type::UInt, v}; }
  static FunctionConstant i32(int index, int32_t v) { return {index, Type::Int, uint32_t(v)}; }
  static FunctionConstant boolean(int index, bool v) { return {index, Type::Bool, v ? 1u : 0u}; }
  static FunctionConstant f32(int index, float v);
};

class Device {
 public:
  // Compiles msl_source into the device's library. Throws MetalError with the compiler's log.
  explicit Device(const std::string& msl_source);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  std::string name() const;
  MTL::Device* device() const { return device_.get(); }
  MTL::CommandQueue* queue() const { return queue_.get(); }

  // Shared-storage buffers (CPU and GPU see the same memory on Apple silicon).
  Ref<MTL::Buffer> new_buffer(size_t bytes);
  Ref<MTL::Buffer> new_buffer(const void* data, size_t bytes);
  // Names a buffer (GPU captures, and the traffic record of the verification harness).
  static void set_label(MTL::Buffer* buffer, const std::string& label);

  // The pipeline for one kernel specialised by constants; built once, then cached (the device owns it).
  MTL::ComputePipelineState* pipeline(const std::string& kernel,
                                      const std::vector<FunctionConstant>& constants = {});
  // Pipelines built so far, and lookups the cache answered (engine.report(); the tests check a decode step builds
  // none once warm).
  int64_t pipelines_built() const { return pipelines_built_; }
  int64_t pipeline_cache_hits() const { return pipeline_cache_hits_; }

 private:
  Ref<MTL::Device> device_;
  Ref<MTL::CommandQueue> queue_;
  Ref<MTL::Library> library_;
  // The cache and its counts are touched only while encoding, which the owner serialises (MetalOps: the engine lock).
  std::map<std::string, Ref<MTL::ComputePipelineState>> pipelines_;
  int64_t pipelines_built_ = 0, pipeline_cache_hits_ = 0;
};

// One argument-table entry of a dispatch: a buffer (with byte offset) or small inline bytes (setBytes).
struct Arg {
  MTL::Buffer* buffer = nullptr;
  size_t offset = 0;
  const void* bytes = nullptr;
  size_t size = 0;

  static Arg buf(MTL::Buffer* b, size_t offset = 0) { return {b, offset, nullptr, 0}; }
  static Arg raw(const void* data, size_t size) { return {nullptr, 0, data, size}; }  // setBytes (<= 4 KB)
  template <class T>
  static Arg value(const T& v) {
    return {nullptr, 0, &v, sizeof(T)};
  }
};

// One command buffer with one concurrent compute encoder. Dispatches recorded between two barrier() calls
// form a stage and may run in any order or overlap on the GPU; barrier() makes the next stage see every
// write of the stages before it. submit() commits and waits (or commit() with a completion callback); a Pass is
// used once.
class Pass {
 public:
  explicit Pass(Device& device);
  ~Pass();
  Pass(const Pass&) = delete;
  Pass& operator=(const Pass&) = delete;

  // args[i] binds to [[buffer(i)]]; threadgroup_bytes[i] sizes [[threadgroup(i)]].
  void dispatch(MTL::ComputePipelineState* pipeline, const std::vector<Arg>& args, MTL::Size threadgroups,
                MTL::Size threads_per_threadgroup, const std::vector<size_t>& threadgroup_bytes = {});
  void barrier();
  void set_label(const std::string& label);  // the command buffer's label ("lily decode step", ...)
  void submit();  // throws MetalError when the command buffer reports an error
  // Ends encoding and commits without waiting; `done` runs on Metal's completion thread with "" or the
  // command buffer's error (a completed handler: the fences of MetalOps).
  void commit(std::function<void(const std::string& error)> done);
  // After commit: blocks until the command buffer completed (waitUntilCompleted).
  void wait_completed();

  Device& device() const { return device_; }
  int dispatches() const { return dispatches_; }
  int stages() const { return stages_; }

 private:
  Device& device_;
  MTL::CommandBuffer* command_buffer_ = nullptr;  // retained by this Pass
  MTL::ComputeCommandEncoder* encoder_ = nullptr;  // retained by this Pass
  bool submitted_ = false;
  int dispatches_ = 0, stages_ = 1;
};

}  // namespace lily::metal
