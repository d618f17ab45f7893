// The one translation unit that instantiates metal-cpp's private implementation: the Objective-C class and
// selector handles every other file's metal-cpp calls refer to. Exactly one file may define these.
#define NS_PRIVATE_IMPLEMENTATION
#define MTL_PRIVATE_IMPLEMENTATION
#include <Foundation/Foundation.hpp>
#include <Metal/Metal.hpp>
