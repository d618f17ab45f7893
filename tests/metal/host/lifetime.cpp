// Object-lifetime mistakes the fake Metal runtime must report (tests/metal/test_fake_runtime.py):
//   clean                  everything released: no report (the control case)
//   leak                   a buffer is never released: the exit report names MTLBuffer
//   release-then-message   contents() sent to a released buffer: use-after-release, naming class and selector
//   release-then-read      a contents() pointer read after the last release: ASan heap-use-after-free
//   autorelease            objects autoreleased into a pool are freed when the pool drains (no report)
//   encoder-after-pool     an encoder (autoreleased, +0) used after its pool drained without a retain: fatal,
//                          "Command encoder released without endEncoding"
//   encoder-retained       the same with encoder->retain() / release(): fine
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

#include <cstdio>
#include <cstring>
#include <string>

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "clean";
  MTL::Device* device = MTL::CreateSystemDefaultDevice();
  MTL::Buffer* buffer = device->newBuffer(256, MTL::ResourceStorageModeShared);
  auto* data = static_cast<float*>(buffer->contents());
  for (int i = 0; i < 64; ++i) data[i] = float(i) + 0.5f;

  if (mode == "leak") {
    device->release();
    return 0;  // buffer never released
  }
  if (mode == "release-then-message") {
    buffer->release();
    fprintf(stderr, "length after release: %lu\n", static_cast<unsigned long>(buffer->length()));
    device->release();
    return 0;
  }
  if (mode == "release-then-read") {
    buffer->release();
    volatile float v = data[7];  // the storage went away with the last reference
    fprintf(stderr, "read %f after release\n", double(v));
    device->release();
    return 0;
  }
  if (mode == "autorelease") {
    NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
    for (int i = 0; i < 10; ++i) {
      device->newBuffer(64, MTL::ResourceStorageModeShared)->autorelease();
      NS::String::string("temporary", NS::UTF8StringEncoding);
    }
    MTL::CommandQueue* queue = device->newCommandQueue();
    MTL::CommandBuffer* cb = queue->commandBuffer();  // autoreleased
    cb->computeCommandEncoder()->endEncoding();
    cb->commit();
    cb->waitUntilCompleted();
    pool->release();
    queue->release();
  }
  if (mode == "encoder-after-pool" || mode == "encoder-retained") {
    MTL::CommandQueue* queue = device->newCommandQueue();
    NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
    MTL::CommandBuffer* cb = queue->commandBuffer()->retain();
    MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder(MTL::DispatchTypeConcurrent);
    if (mode == "encoder-retained") enc->retain();
    pool->release();
    enc->endEncoding();
    if (mode == "encoder-retained") enc->release();
    cb->commit();
    cb->waitUntilCompleted();
    cb->release();
    queue->release();
  }
  buffer->release();
  device->release();
  return 0;
}
