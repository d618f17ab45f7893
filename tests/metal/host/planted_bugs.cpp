// Host-code mistakes the L1 compile check (metalsim.host.compile_check) must reject. Built as is, this file
// is correct Metal host code and compiles cleanly; each PLANT_* define swaps one line for a plausible mistake:
//   PLANT_SETBUFFER_ARGS   setBuffer(buffer, 0): the argument-table index is missing
//   PLANT_BARRIER_ENUM     MTL::BarrierScopeBuffer: the enumerator is BarrierScopeBuffers
//   PLANT_WAIT_NAME        waitUntilComplete(): the method is waitUntilCompleted
//   PLANT_DISPATCH_ARGS    dispatchThreadgroups with one MTL::Size instead of two
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>

void encode_and_wait(MTL::CommandQueue* queue, MTL::ComputePipelineState* pipeline, MTL::Buffer* buffer) {
  MTL::CommandBuffer* cb = queue->commandBuffer();
  MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder(MTL::DispatchTypeConcurrent);
  enc->setComputePipelineState(pipeline);
#ifdef PLANT_SETBUFFER_ARGS
  enc->setBuffer(buffer, 0);
#else
  enc->setBuffer(buffer, 0, 0);
#endif
#ifdef PLANT_DISPATCH_ARGS
  enc->dispatchThreadgroups(MTL::Size(1, 1, 1));
#else
  enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(32, 1, 1));
#endif
#ifdef PLANT_BARRIER_ENUM
  enc->memoryBarrier(MTL::BarrierScopeBuffer);
#else
  enc->memoryBarrier(MTL::BarrierScopeBuffers);
#endif
  enc->endEncoding();
  cb->commit();
#ifdef PLANT_WAIT_NAME
  cb->waitUntilComplete();
#else
  cb->waitUntilCompleted();
#endif
}
