// Stub of Apple's <objc/runtime.h> for compiling metal-cpp on Linux (declarations only; the fake runtime in
// tools/metalsim/fakemetal defines them). objc_object must be complete: NS::Object derives from it.
#pragma once
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct objc_class* Class;
struct objc_object {
  Class isa;
};
typedef struct objc_object* id;
typedef struct objc_selector* SEL;
typedef struct objc_object Protocol;
typedef id (*IMP)(id, SEL, ...);

Class objc_lookUpClass(const char* name);
Protocol* objc_getProtocol(const char* name);
SEL sel_registerName(const char* name);
const char* sel_getName(SEL sel);
const char* class_getName(Class cls);
Class object_getClass(id obj);

#ifdef __cplusplus
}
#endif
