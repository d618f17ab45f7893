// Stub of Apple's <objc/message.h>: the message-send trampolines. metal-cpp casts them to typed function
// pointers, so they are declared without parameters, as in Apple's header under OBJC_OLD_DISPATCH_PROTOTYPES=0.
#pragma once
#include <objc/runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

void objc_msgSend(void);
void objc_msgSend_stret(void);
void objc_msgSend_fpret(void);

#ifdef __cplusplus
}
#endif
