// Stub of Apple's <IOSurface/IOSurfaceRef.h>: an opaque handle named by MTLDevice / MTLTexture.
#pragma once
typedef struct __IOSurface* IOSurfaceRef;
