// Stub of Apple's <CoreFoundation/CoreFoundation.h>: the few types metal-cpp uses. Apple's header also pulls in
// math.h (INFINITY in MTLAccelerationStructureTypes.hpp) and the dispatch and mach types, so this one does too.
#pragma once
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <TargetConditionals.h>
#include <dispatch/dispatch.h>
#include <mach/mach.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef double CFTimeInterval;
typedef const struct __CFString* CFStringRef;
typedef const void* CFTypeRef;
typedef signed long CFIndex;
typedef struct {
  CFIndex location;
  CFIndex length;
} CFRange;

#ifdef __cplusplus
}
#endif
