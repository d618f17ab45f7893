// Device, pipeline cache and Pass (see device.h). Every method that may create autoreleased objects (strings,
// errors, command buffers) runs inside its own autorelease pool, so nothing accumulates in a host process that
// has no run loop; objects kept beyond the call are retained explicitly.
#include "metal/device.h"

#include <cstring>

namespace lily::metal {

namespace {

// Drains the autoreleased objects made inside one method call.
class PoolScope {
 public:
  PoolScope() : pool_(NS::AutoreleasePool::alloc()->init()) {}
  ~PoolScope() { pool_->release(); }
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  NS::AutoreleasePool* pool_;
};

NS::String* ns_string(const std::string& s) { return NS::String::string(s.c_str(), NS::UTF8StringEncoding); }

std::string describe(NS::Error* error) {
  if (!error) return "unknown error";
  NS::String* text = error->localizedDescription();
  return text ? std::string(text->utf8String()) : "unknown error";
}

MTL::DataType data_type(FunctionConstant::Type t) {
  switch (t) {
    case FunctionConstant::Type::Bool: return MTL::DataTypeBool;
    case FunctionConstant::Type::Int: return MTL::DataTypeInt;
    case FunctionConstant::Type::UInt: return MTL::DataTypeUInt;
    case FunctionConstant::Type::Float: return MTL::DataTypeFloat;
  }
  return MTL::DataTypeUInt;
}

std::string pipeline_key(const std::string& kernel, const std::vector<FunctionConstant>& constants) {
  std::string key = kernel;
  for (const auto& c : constants)
    key += "|" + std::to_string(c.index) + ":" + std::to_string(int(c.type)) + ":" + std::to_string(c.bits);
  return key;
}

}  // namespace

FunctionConstant FunctionConstant::f32(int index, float v) {
  FunctionConstant c{index, Type::Float, 0};
  std::memcpy(&c.bits, &v, sizeof v);
  return c;
}

Device::Device(const std::string& msl_source) {
  PoolScope pool;
  device_ = Ref<MTL::Device>(MTL::CreateSystemDefaultDevice());
  if (!device_) throw MetalError("no Metal device is available");
  queue_ = Ref<MTL::CommandQueue>(device_->newCommandQueue());
  if (!queue_) throw MetalError("could not create a Metal command queue");

  Ref<MTL::CompileOptions> options(MTL::CompileOptions::alloc()->init());
  // Kernels are written for MSL 3.1 (macOS 14): bfloat and the simdgroup functions they use.
  options->setLanguageVersion(MTL::LanguageVersion3_1);
  // Safe math, as MLX compiles its kernels: exact division, IEEE NaN/Inf handling and no approximate exp/log.
  // The kernels' numerics are verified against the CPU backend in the Linux emulator, which computes exactly
  // this way; fast math (Metal's default) would make the GPU compute something the emulator never checked.
  // fastMathEnabled is the macOS 14 switch; mathMode (macOS 15+) supersedes it, set only where it exists.
  options->setFastMathEnabled(false);
  // (metal-cpp keeps respondsToSelector protected: ask through objc_msgSend as metal-cpp itself does.)
  const auto responds = reinterpret_cast<bool (*)(const void*, SEL, SEL)>(&objc_msgSend);
  if (responds(options.get(), sel_registerName("respondsToSelector:"), sel_registerName("setMathMode:")))
    options->setMathMode(MTL::MathModeSafe);
  NS::Error* error = nullptr;
  library_ = Ref<MTL::Library>(device_->newLibrary(ns_string(msl_source), options.get(), &error));
  if (!library_) throw MetalError("compiling Lily's Metal kernels failed: " + describe(error));
}

Device::~Device() = default;

std::string Device::name() const {
  PoolScope pool;
  NS::String* n = device_->name();
  return n ? std::string(n->utf8String()) : std::string("unnamed Metal device");
}

Ref<MTL::Buffer> Device::new_buffer(size_t bytes) {
  // Metal rejects zero-length buffers; a one-byte buffer keeps empty tensors bindable.
  Ref<MTL::Buffer> b(device_->newBuffer(bytes ? bytes : 1, MTL::ResourceStorageModeShared));
  if (!b) throw MetalError("allocating a Metal buffer of " + std::to_string(bytes) + " bytes failed");
  return b;
}

Ref<MTL::Buffer> Device::new_buffer(const void* data, size_t bytes) {
  Ref<MTL::Buffer> b = new_buffer(bytes);
  if (bytes) std::memcpy(b->contents(), data, bytes);
  return b;
}

MTL::ComputePipelineState* Device::pipeline(const std::string& kernel,
                                            const std::vector<FunctionConstant>& constants) {
  const std::string key = pipeline_key(kernel, constants);
  auto it = pipelines_.find(key);
  if (it != pipelines_.end()) {
    ++pipeline_cache_hits_;
    return it->second.get();
  }

  PoolScope pool;
  NS::Error* error = nullptr;
  Ref<MTL::Function> function;
  if (constants.empty()) {
    function = Ref<MTL::Function>(library_->newFunction(ns_string(kernel)));
  } else {
    Ref<MTL::FunctionConstantValues> values(MTL::FunctionConstantValues::alloc()->init());
    for (const auto& c : constants) values->setConstantValue(&c.bits, data_type(c.type), NS::UInteger(c.index));
    function = Ref<MTL::Function>(library_->newFunction(ns_string(kernel), values.get(), &error));
  }
  if (!function)
    throw MetalError(error ? "specialising Metal kernel '" + kernel + "' failed: " + describe(error)
                           : "Metal kernel '" + kernel + "' is not in the library");
  Ref<MTL::ComputePipelineState> state(device_->newComputePipelineState(function.get(), &error));
  if (!state) throw MetalError("building the pipeline for '" + kernel + "' failed: " + describe(error));
  ++pipelines_built_;
  return pipelines_.emplace(key, std::move(state)).first->second.get();
}

void Device::set_label(MTL::Buffer* buffer, const std::string& label) {
  PoolScope pool;
  buffer->setLabel(ns_string(label));
}

void Pass::set_label(const std::string& label) {
  PoolScope pool;
  command_buffer_->setLabel(ns_string(label));
}

Pass::Pass(Device& device) : device_(device) {
  PoolScope pool;
  command_buffer_ = device_.queue()->commandBuffer();
  if (!command_buffer_) throw MetalError("could not create a Metal command buffer");
  command_buffer_->retain();
  encoder_ = command_buffer_->computeCommandEncoder(MTL::DispatchTypeConcurrent);
  if (!encoder_) {
    command_buffer_->release();
    throw MetalError("could not create a concurrent compute encoder");
  }
  encoder_->retain();  // autoreleased: keep it beyond this constructor's pool
}

Pass::~Pass() {
  if (!submitted_) {
    // Abandoned (an exception while encoding): close the encoder so the command buffer can be freed.
    encoder_->endEncoding();
  }
  encoder_->release();
  command_buffer_->release();
}

void Pass::dispatch(MTL::ComputePipelineState* pipeline, const std::vector<Arg>& args, MTL::Size threadgroups,
                    MTL::Size threads_per_threadgroup, const std::vector<size_t>& threadgroup_bytes) {
  if (submitted_) throw MetalError("Pass::dispatch after submit");
  const NS::UInteger threads =
      threads_per_threadgroup.width * threads_per_threadgroup.height * threads_per_threadgroup.depth;
  if (threads == 0 || threads > pipeline->maxTotalThreadsPerThreadgroup())
    throw MetalError("threadgroup of " + std::to_string(threads) + " threads exceeds the pipeline's limit of " +
                     std::to_string(pipeline->maxTotalThreadsPerThreadgroup()));
  encoder_->setComputePipelineState(pipeline);
  for (size_t i = 0; i < args.size(); ++i) {
    const Arg& a = args[i];
    if (a.buffer)
      encoder_->setBuffer(a.buffer, NS::UInteger(a.offset), NS::UInteger(i));
    else
      encoder_->setBytes(a.bytes, NS::UInteger(a.size), NS::UInteger(i));
  }
  for (size_t i = 0; i < threadgroup_bytes.size(); ++i)
    if (threadgroup_bytes[i])  // Metal wants threadgroup lengths in multiples of 16 bytes
      encoder_->setThreadgroupMemoryLength(NS::UInteger((threadgroup_bytes[i] + 15) / 16 * 16), NS::UInteger(i));
  encoder_->dispatchThreadgroups(threadgroups, threads_per_threadgroup);
  ++dispatches_;
}

void Pass::barrier() {
  if (submitted_) throw MetalError("Pass::barrier after submit");
  encoder_->memoryBarrier(MTL::BarrierScopeBuffers);
  ++stages_;
}

void Pass::submit() {
  if (submitted_) throw MetalError("Pass::submit called twice");
  submitted_ = true;
  encoder_->endEncoding();
  command_buffer_->commit();
  command_buffer_->waitUntilCompleted();
  if (command_buffer_->status() == MTL::CommandBufferStatusError) {
    PoolScope pool;
    throw MetalError("Metal command buffer failed: " + describe(command_buffer_->error()));
  }
}

}  // namespace lily::metal

namespace lily::metal {

void Pass::commit(std::function<void(const std::string& error)> done) {
  if (submitted_) throw MetalError("Pass::commit called twice");
  submitted_ = true;
  encoder_->endEncoding();
  // The handler owns `done`; metal-cpp copies the std::function into the block it registers.
  const MTL::HandlerFunction handler = [done = std::move(done)](MTL::CommandBuffer* cb) {
    PoolScope pool;
    std::string error;
    if (cb->status() == MTL::CommandBufferStatusError)
      error = "Metal command buffer failed: " + describe(cb->error());
    done(error);
  };
  command_buffer_->addCompletedHandler(handler);
  command_buffer_->commit();
}

void Pass::wait_completed() {
  if (!submitted_) throw MetalError("Pass::wait_completed before commit");
  command_buffer_->waitUntilCompleted();
}

}  // namespace lily::metal
