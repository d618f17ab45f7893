// Stub of Apple's <mach/mach.h>: the integer types MTLResource names.
#pragma once
typedef int kern_return_t;
typedef unsigned int mach_port_t;
typedef mach_port_t task_id_token_t;
