// Dispatch behaviour of the fake Metal runtime, driven through Lily's Device / Pass and raw metal-cpp, with the
// real row_dot and qmv4 kernels (metal/*.metal files on the command line). Each case prints one line,
// "<case>: ok <value>" or "<case>: error <message>"; the process must survive every case.
//   unbound        the shape argument [[buffer(3)]] is not bound -> the command buffer fails (NSError)
//   short          the shape argument (constant RowDotShape&, 8 bytes) gets 4 bytes -> the command buffer fails
//   ok             a correct dispatch: 1.5·2 − 2·0.5 − 0.25·4 + 3·1 = 4 (the device is still usable)
//   threads        the same through dispatchThreads with a partial threadgroup (32 of 128 threads)
//   constant-type  qmv4's uint group-size constant given as a float -> newFunction fails (NSError)
//   serial         t = a·b, then u = t·2 on a serial encoder: 8 even with FAKEMETAL_REVERSE=1 (every dispatch is
//                  its own stage); also counts completed-handler calls (a metal-cpp std::function handler)
//   no-barrier     the same two dispatches on a concurrent encoder without a barrier: 0 under FAKEMETAL_REVERSE=1
//   resource-barrier  concurrent, separated by memoryBarrier(resources, count): 8
//   wrong-resource-barrier  the resource barrier lists the wrong buffer (two, not t): it orders nothing here
//   texture-barrier  memoryBarrier(MTL::BarrierScopeTextures): orders no buffer
//   info           the other message-send paths: a struct returned in memory (maxThreadsPerThreadgroup,
//                  objc_msgSend_stret), doubles (GPUStartTime / GPUEndTime, objc_msgSend_fpret), an MTLSTR
//                  literal and pipeline limits
// If the library does not compile, prints "library: error <message>" and exits 0.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <sstream>
#include <string>

#include "metal/kernels.h"

using namespace lily::metal;

namespace {
struct RowDotShape {  // metal/reduce.metal
  uint32_t rows, cols;
};

float run_chain(Device& device, const std::string& how, int* handler_calls) {
  const float a[4] = {1.5f, -2.0f, 0.25f, 3.0f}, b[4] = {2.0f, 0.5f, -4.0f, 1.0f}, two = 2.0f;
  Ref<MTL::Buffer> a_buf = device.new_buffer(a, sizeof a), b_buf = device.new_buffer(b, sizeof b);
  Ref<MTL::Buffer> two_buf = device.new_buffer(&two, sizeof two);
  Ref<MTL::Buffer> t = device.new_buffer(sizeof(float)), u = device.new_buffer(sizeof(float));
  MTL::ComputePipelineState* row_dot = device.pipeline("row_dot");
  const RowDotShape first{1, 4}, second{1, 1};

  NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
  MTL::CommandBuffer* cb = device.queue()->commandBuffer();
  // Completed handlers run on another thread, possibly after waitUntilCompleted returns (Metal promises no
  // order between the two), so the handler's count is handed over through a promise.
  auto handled = std::make_shared<std::promise<void>>();
  std::future<void> handler_done = handled->get_future();
  cb->addCompletedHandler([handler_calls, handled](MTL::CommandBuffer*) {
    ++*handler_calls;
    handled->set_value();
  });
  MTL::ComputeCommandEncoder* enc =
      how == "serial" ? cb->computeCommandEncoder() : cb->computeCommandEncoder(MTL::DispatchTypeConcurrent);
  enc->setComputePipelineState(row_dot);
  enc->setBuffer(a_buf.get(), 0, 0);
  enc->setBuffer(b_buf.get(), 0, 1);
  enc->setBuffer(t.get(), 0, 2);
  enc->setBytes(&first, sizeof first, 3);
  enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(32, 1, 1));
  if (how == "resource-barrier" || how == "wrong-resource-barrier") {
    MTL::Resource* written[] = {how == "resource-barrier" ? t.get() : two_buf.get()};
    enc->memoryBarrier(written, 1);
  }
  if (how == "texture-barrier") enc->memoryBarrier(MTL::BarrierScopeTextures);
  enc->setBuffer(t.get(), 0, 0);
  enc->setBuffer(two_buf.get(), 0, 1);
  enc->setBuffer(u.get(), 0, 2);
  enc->setBytes(&second, sizeof second, 3);
  enc->dispatchThreadgroups(MTL::Size(1, 1, 1), MTL::Size(32, 1, 1));
  enc->endEncoding();
  cb->commit();
  cb->waitUntilCompleted();
  const bool failed = cb->status() != MTL::CommandBufferStatusCompleted;
  const std::string why = failed && cb->error() ? cb->error()->localizedDescription()->utf8String() : "";
  if (handler_done.wait_for(std::chrono::seconds(30)) != std::future_status::ready) throw MetalError("no handler");
  pool->release();
  if (failed) throw MetalError("command buffer failed: " + why);
  return *static_cast<float*>(u->contents());
}

void run_case(Device& device, const std::string& name) {
  const float a[4] = {1.5f, -2.0f, 0.25f, 3.0f}, b[4] = {2.0f, 0.5f, -4.0f, 1.0f};
  Ref<MTL::Buffer> a_buf = device.new_buffer(a, sizeof a);
  Ref<MTL::Buffer> b_buf = device.new_buffer(b, sizeof b);
  Ref<MTL::Buffer> out = device.new_buffer(sizeof(float));
  const RowDotShape shape{1, 4};
  const uint32_t rows_only = 1;
  std::vector<Arg> args = {Arg::buf(a_buf.get()), Arg::buf(b_buf.get()), Arg::buf(out.get()), Arg::value(shape)};
  try {
    if (name == "serial" || name == "no-barrier" || name == "resource-barrier" || name == "wrong-resource-barrier" ||
        name == "texture-barrier") {
      int calls = 0;
      const float u = run_chain(device, name, &calls);
      printf("%s: ok %g handlers=%d\n", name.c_str(), double(u), calls);
      return;
    }
    if (name == "info") {
      NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
      const MTL::Size m = device.device()->maxThreadsPerThreadgroup();
      NS::String* literal = MTLSTR("row_dot");
      MTL::ComputePipelineState* p = device.pipeline(literal->utf8String());
      MTL::CommandBuffer* cb = device.queue()->commandBuffer();
      cb->computeCommandEncoder()->endEncoding();
      cb->commit();
      cb->waitUntilCompleted();
      const double start = cb->GPUStartTime(), end = cb->GPUEndTime();
      printf("%s: ok max=%lux%lux%lu literal=%s/%lu pipeline=%lu/%lu time=%s\n", name.c_str(),
             (unsigned long)m.width, (unsigned long)m.height, (unsigned long)m.depth, literal->utf8String(),
             (unsigned long)literal->length(), (unsigned long)p->maxTotalThreadsPerThreadgroup(),
             (unsigned long)p->threadExecutionWidth(), start > 0 && end >= start ? "ordered" : "wrong");
      pool->release();
      return;
    }
    if (name == "constant-type") {
      device.pipeline("qmv4_bf16", {FunctionConstant::f32(0, 64.0f)});
      printf("%s: ok pipeline built\n", name.c_str());
      return;
    }
    if (name == "unbound") args.pop_back();
    if (name == "short") args[3] = Arg::value(rows_only);
    if (name == "threads") {
      NS::AutoreleasePool* pool = NS::AutoreleasePool::alloc()->init();
      MTL::CommandBuffer* cb = device.queue()->commandBuffer();
      MTL::ComputeCommandEncoder* enc = cb->computeCommandEncoder(MTL::DispatchTypeConcurrent);
      enc->setComputePipelineState(device.pipeline("row_dot"));
      enc->setBuffer(a_buf.get(), 0, 0);
      enc->setBuffer(b_buf.get(), 0, 1);
      enc->setBuffer(out.get(), 0, 2);
      enc->setBytes(&shape, sizeof shape, 3);
      enc->dispatchThreads(MTL::Size(32, 1, 1), MTL::Size(128, 1, 1));
      enc->endEncoding();
      cb->commit();
      cb->waitUntilCompleted();
      pool->release();
    } else {
      Pass pass(device);
      pass.dispatch(device.pipeline("row_dot"), args, MTL::Size(1, 1, 1), MTL::Size(32, 1, 1));
      pass.submit();
    }
    printf("%s: ok %g\n", name.c_str(), double(*static_cast<float*>(out->contents())));
  } catch (const MetalError& e) {
    printf("%s: error %s\n", name.c_str(), e.what());
  }
}
}  // namespace

int main(int argc, char** argv) {
  std::string msl;
  std::vector<std::string> cases;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.size() > 6 && a.compare(a.size() - 6, 6, ".metal") == 0) {
      std::ifstream f(a);
      std::stringstream s;
      s << f.rdbuf();
      msl += s.str() + "\n";
    } else {
      cases.push_back(a);
    }
  }
  try {
    Device device(msl);
    for (const auto& c : cases) run_case(device, c);
  } catch (const MetalError& e) {
    printf("library: error %s\n", e.what());
  }
  fflush(stdout);
  return 0;
}
