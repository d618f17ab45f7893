// Stub of Apple's <dispatch/dispatch.h>: opaque queue and data handles named by MTLDevice / MTLEvent.
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_data_s* dispatch_data_t;
