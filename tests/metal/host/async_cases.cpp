// Asynchronous command buffers, in-flight buffer protection, device limits, static threadgroup memory and the
// math mode, on the fake Metal runtime through raw metal-cpp (tests/metal/test_fake_async.py). Each case prints
// "<case>: <result>"; the planted bugs (read-in-flight, write-in-flight) must be stopped by the fake instead.
//   status           NotEnqueued -> Enqueued -> Committed (commit returns before the work ran) -> Completed
//   handler-thread   the completed handler runs on another thread than the one that committed
//   enqueue-order    b enqueued before a runs first, although a is committed first
//   two-in-flight    two command buffers alternate, the host reads the older one's output while the newer one
//                    runs (a one-step-behind token read): allowed
//   read-input       the host reads an input buffer of an in-flight command buffer: allowed (both only read)
//   read-in-flight   planted bug: reading the output of a command buffer before waiting for it
//   write-in-flight  planted bug: writing an input of a command buffer before it completed
//   limits           maxBufferLength, maxThreadsPerThreadgroup, a too-large buffer (nil) and a too-large
//                    threadgroup (the command buffer fails)
//   static-tg        staticThreadgroupMemoryLength; static + setThreadgroupMemoryLength over the limit fails
//   fast-math        a library compiled with Metal's default (fast) math is refused; safe math compiles
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {
const char* kSource = R"msl(
#include <metal_stdlib>
using namespace metal;
kernel void scale(device const float* a [[buffer(0)]], device float* out [[buffer(1)]],
                  constant float& s [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  out[i] = a[i] * s;
}
kernel void tiled(device float* out [[buffer(0)]], threadgroup float* extra [[threadgroup(0)]],
                  uint i [[thread_index_in_threadgroup]]) {
  threadgroup float tile[1024];
  tile[i] = float(i);
  extra[0] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = tile[i] + extra[0];
}
)msl";

struct Ctx {
  MTL::Device* device = nullptr;
  MTL::CommandQueue* queue = nullptr;
  MTL::Library* library = nullptr;
  MTL::ComputePipelineState* scale = nullptr;
  MTL::ComputePipelineState* tiled = nullptr;
};

MTL::Library* compile(MTL::Device* device, bool safe, std::string* err) {
  MTL::CompileOptions* options = MTL::CompileOptions::alloc()->init();
  if (safe) {
    options->setFastMathEnabled(false);
    options->setMathMode(MTL::MathModeSafe);
  }
  NS::Error* error = nullptr;
  MTL::Library* lib = device->newLibrary(NS::String::string(kSource, NS::UTF8StringEncoding), options, &error);
  options->release();
  if (!lib && err) *err = error ? error->localizedDescription()->utf8String() : "?";
  return lib;
}

MTL::ComputePipelineState* pipeline(Ctx& c, const char* name) {
  MTL::Function* f = c.library->newFunction(NS::String::string(name, NS::UTF8StringEncoding));
  NS::Error* error = nullptr;
  MTL::ComputePipelineState* p = c.device->newComputePipelineState(f, &error);
  f->release();
  return p;
}

MTL::Buffer* buffer(Ctx& c, const char* label, const std::vector<float>& v) {
  MTL::Buffer* b = c.device->newBuffer(v.data(), v.size() * sizeof(float), MTL::ResourceStorageModeShared);
  b->setLabel(NS::String::string(label, NS::UTF8StringEncoding));
  return b;
}

// out = a * s on a new command buffer (committed, not waited for).
MTL::CommandBuffer* scale(Ctx& c, MTL::Buffer* a, MTL::Buffer* out, float s, const char* label) {
  MTL::CommandBuffer* cb = c.queue->commandBuffer();
  cb->setLabel(NS::String::string(label, NS::UTF8StringEncoding));
  MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder();
  enc->setComputePipelineState(c.scale);
  enc->setBuffer(a, 0, 0);
  enc->setBuffer(out, 0, 1);
  enc->setBytes(&s, sizeof s, 2);
  enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(4, 1, 1));
  enc->endEncoding();
  return cb;
}

float at(MTL::Buffer* b, int i) { return static_cast<float*>(b->contents())[i]; }

void run_case(Ctx& c, const std::string& name) {
  NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
  MTL::Buffer* a = buffer(c, "a", {1, 2, 3, 4});
  MTL::Buffer* out = buffer(c, "out", {0, 0, 0, 0});
  MTL::Buffer* out2 = buffer(c, "out2", {0, 0, 0, 0});
  if (name == "status") {
    MTL::CommandBuffer* cb = scale(c, a, out, 2, "step");
    std::string seen = std::to_string(cb->status());
    cb->enqueue();
    seen += std::to_string(cb->status());
    cb->commit();
    seen += std::to_string(cb->status());  // the GPU thread has not started it yet
    cb->waitUntilScheduled();
    seen += cb->status() >= MTL::CommandBufferStatusScheduled ? "s" : "?";
    cb->waitUntilCompleted();
    seen += std::to_string(cb->status());
    printf("%s: %s out=%g\n", name.c_str(), seen.c_str(), double(at(out, 3)));
  } else if (name == "handler-thread") {
    MTL::CommandBuffer* cb = scale(c, a, out, 2, "step");
    auto done = std::make_shared<std::promise<std::thread::id>>();
    std::future<std::thread::id> tid = done->get_future();
    cb->addCompletedHandler([done](MTL::CommandBuffer* b) {
      done->set_value(b->status() == MTL::CommandBufferStatusCompleted ? std::this_thread::get_id() : std::thread::id());
    });
    cb->commit();
    cb->waitUntilCompleted();
    const std::thread::id t = tid.get();
    printf("%s: %s\n", name.c_str(), t == std::thread::id() ? "not completed" : t == std::this_thread::get_id() ? "same thread" : "other thread");
  } else if (name == "enqueue-order") {
    std::vector<std::string> order;
    std::mutex mu;
    MTL::CommandBuffer* first = scale(c, a, out, 2, "a");
    MTL::CommandBuffer* second = scale(c, a, out2, 3, "b");
    for (MTL::CommandBuffer* cb : {first, second})
      cb->addCompletedHandler([&order, &mu](MTL::CommandBuffer* b) {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(b->label()->utf8String());
      });
    second->enqueue();
    first->commit();
    second->commit();
    first->waitUntilCompleted();
    second->waitUntilCompleted();
    for (int i = 0; i < 200 && order.size() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::lock_guard<std::mutex> lock(mu);
    printf("%s: %s\n", name.c_str(), (order.size() == 2 ? order[0] + order[1] : std::string("missing")).c_str());
  } else if (name == "two-in-flight") {
    float sum = 0;
    MTL::CommandBuffer* prev = scale(c, a, out, 1, "step0");
    prev->commit();
    for (int step = 1; step <= 4; ++step) {
      MTL::CommandBuffer* next = scale(c, a, step % 2 ? out2 : out, float(step + 1), "step");
      next->commit();
      prev->waitUntilCompleted();
      sum += at(step % 2 ? out : out2, 3);  // the previous step's output, while `next` is in flight
      prev = next;
    }
    prev->waitUntilCompleted();
    sum += at(out, 3);
    printf("%s: ok %g\n", name.c_str(), double(sum));  // 4 * (1 + 2 + 3 + 4 + 5) = 60
  } else if (name == "read-input") {
    MTL::CommandBuffer* cb = scale(c, a, out, 2, "step");
    cb->commit();
    const float x = at(a, 2);
    cb->waitUntilCompleted();
    printf("%s: ok %g %g\n", name.c_str(), double(x), double(at(out, 2)));
  } else if (name == "read-in-flight") {
    MTL::CommandBuffer* cb = scale(c, a, out, 2, "step");
    cb->commit();
    printf("%s: read %g\n", name.c_str(), double(at(out, 0)));  // the bug: no wait before the read
    fflush(stdout);
    cb->waitUntilCompleted();
  } else if (name == "write-in-flight") {
    MTL::CommandBuffer* cb = scale(c, a, out, 2, "step");
    cb->commit();
    static_cast<float*>(a->contents())[1] = 10.0f;  // the bug: the kernel may still read it
    cb->waitUntilCompleted();
    printf("%s: wrote, out=%g\n", name.c_str(), double(at(out, 1)));
  } else if (name == "limits") {
    MTL::Buffer* big = c.device->newBuffer(c.device->maxBufferLength() + 1, MTL::ResourceStorageModeShared);
    MTL::CommandBuffer* cb = c.queue->commandBuffer();
    MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder();
    enc->setComputePipelineState(c.scale);
    MTL::Buffer* wide = c.device->newBuffer(4096 * sizeof(float), MTL::ResourceStorageModeShared);
    const float s = 1;
    enc->setBuffer(wide, 0, 0);
    enc->setBuffer(wide, 0, 1);
    enc->setBytes(&s, sizeof s, 2);
    const unsigned long n = c.scale->maxTotalThreadsPerThreadgroup() * 2;
    enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(n, 1, 1));
    enc->endEncoding();
    cb->commit();
    cb->waitUntilCompleted();
    printf("%s: maxBuffer=%lu workingSet=%llu maxThreads=%lu pipeline=%lu big=%s status=%lu %s\n", name.c_str(),
           (unsigned long)c.device->maxBufferLength(), (unsigned long long)c.device->recommendedMaxWorkingSetSize(),
           (unsigned long)c.device->maxThreadsPerThreadgroup().width,
           (unsigned long)c.scale->maxTotalThreadsPerThreadgroup(), big ? "buffer" : "nil", (unsigned long)cb->status(),
           cb->error() ? cb->error()->localizedDescription()->utf8String() : "");
    wide->release();
  } else if (name == "static-tg") {
    std::string result = "static=" + std::to_string(c.tiled->staticThreadgroupMemoryLength());
    for (unsigned long extra : {16ul, c.device->maxThreadgroupMemoryLength()}) {
      MTL::CommandBuffer* cb = c.queue->commandBuffer();
      MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder();
      enc->setComputePipelineState(c.tiled);
      enc->setBuffer(out, 0, 0);
      enc->setThreadgroupMemoryLength(extra, 0);
      enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(4, 1, 1));
      enc->endEncoding();
      cb->commit();
      cb->waitUntilCompleted();
      result += " " + std::to_string(cb->status()) +
                (cb->error() ? std::string(" ") + cb->error()->localizedDescription()->utf8String() : "");
    }
    printf("%s: %s\n", name.c_str(), result.c_str());
  } else if (name == "fast-math") {
    std::string err;
    MTL::Library* fast = compile(c.device, false, &err);
    printf("%s: %s\n", name.c_str(), fast ? "compiled" : err.c_str());
    if (fast) fast->release();
  }
  a->release();
  out->release();
  out2->release();
  pool->release();
}
}  // namespace

int main(int argc, char** argv) {
  NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
  Ctx c;
  c.device = MTL::CreateSystemDefaultDevice();
  c.queue = c.device->newCommandQueue();
  std::string err;
  c.library = compile(c.device, true, &err);
  if (!c.library) {
    printf("library: error %s\n", err.c_str());
    pool->release();
    return 1;
  }
  c.scale = pipeline(c, "scale");
  c.tiled = pipeline(c, "tiled");
  for (int i = 1; i < argc; ++i) run_case(c, argv[i]);
  fflush(stdout);
  c.scale->release();
  c.tiled->release();
  c.library->release();
  c.queue->release();
  c.device->release();
  pool->release();
  return 0;
}
