// The object model of the fake Objective-C runtime (tools/metalsim/fakemetal): classes with per-selector
// C++ implementations, reference-counted objects that turn into zombies when released (so a later message is
// reported as use-after-release instead of reading freed memory), per-thread autorelease pools, NSString /
// NSError / NSArray, and a leak report at exit. Metal's classes (metal.cpp) are built on it.
#pragma once
#include <objc/runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace fakemetal {
struct ClassInfo;
}

// A class object. Classes receive messages too (alloc, new, stringWithCString:encoding:), so a class object
// starts with isa like every object; its isa is the metaclass marker.
struct objc_class {
  Class isa;
  fakemetal::ClassInfo* info;
};

namespace fakemetal {

using Imp = void*;  // a C++ function cast to void*; called through objc_msgSend with its real signature

struct ClassInfo {
  std::string name;
  ClassInfo* super = nullptr;
  std::unordered_map<SEL, Imp> methods;        // instance methods
  std::unordered_map<SEL, Imp> class_methods;  // class methods
  struct objc_object* (*make)() = nullptr;     // +alloc: a new instance with one reference (nullptr: abstract)
  objc_class cls{};                            // the class object, what objc_lookUpClass returns
};

// Every object the runtime hands out. The concrete C++ type's destructor runs at the last release; the
// memory then becomes a Zombie that remembers the class, so a stale pointer stays recognisable (zombies are
// freed oldest first only beyond FAKEMETAL_ZOMBIE_MB, default 256 MB).
struct Obj : objc_object {
  std::atomic<long> refs{1};
  ClassInfo* info = nullptr;
  size_t bytes = 0;  // allocation size (at least 64: a Zombie must fit)
};

SEL sel(const char* name);                 // sel_registerName
ClassInfo& define_class(const char* name, const char* super_name);  // registers (or returns) a class
ClassInfo* find_class(const char* name);
const char* class_name(const objc_object* o);  // the class of a live object, a constant string or a zombie

template <class F>
void def(ClassInfo& c, const char* selector, F* fn) {
  c.methods[sel(selector)] = reinterpret_cast<Imp>(fn);
}
template <class F>
void def_class(ClassInfo& c, const char* selector, F* fn) {
  c.class_methods[sel(selector)] = reinterpret_cast<Imp>(fn);
}

// Object lifetime. new_object constructs T with one reference and registers it as live.
void register_live(Obj* o, ClassInfo& c, void (*destroy)(Obj*));
size_t object_bytes(size_t type_size);
template <class T, class... A>
T* new_object(ClassInfo& c, A&&... args) {
  const size_t bytes = object_bytes(sizeof(T));
  void* mem = ::operator new(bytes);
  T* t = new (mem) T(std::forward<A>(args)...);
  t->bytes = bytes;
  register_live(t, c, [](Obj* o) { static_cast<T*>(o)->~T(); });
  return t;
}
void retain(objc_object* o);
void release(objc_object* o);
objc_object* autorelease(objc_object* o);
bool is_live_object(const objc_object* o);  // a live object of this runtime (not a zombie, not a string literal)

// Raises a fatal error: prints "fakemetal: <message>" and aborts.
// Called first at exit, before the leak report (the Metal classes finish committed work there).
extern void (*g_before_exit_report)();
[[noreturn]] void die(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void warn(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Foundation objects the Metal classes create.
objc_object* make_string(const std::string& utf8);  // +1 NSString
std::string string_value(const objc_object* s);     // NSString or string literal -> UTF-8 (nil -> "")
objc_object* make_error(const char* domain, long code, const std::string& description);  // +1 NSError
objc_object* make_array(const std::vector<objc_object*>& items);  // +1 NSArray, retains the items

// Blocks (Apple's Blocks ABI): copy to the heap, invoke, release.
struct BlockLayout {
  void* isa;
  int flags;
  int reserved;
  void* invoke;
  void* descriptor;
};
void* block_copy(const void* block);
void block_release(const void* block);

void register_metal_classes();  // metal.cpp

}  // namespace fakemetal
