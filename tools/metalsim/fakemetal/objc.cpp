// The fake Objective-C runtime behind metal-cpp on Linux: objc_lookUpClass / sel_registerName, the lookup
// that the objc_msgSend trampoline (msgsend_x86_64.S) calls, NSObject's reference counting with zombies and
// a leak report at exit, NSAutoreleasePool, NSString (including MTLSTR literals), NSError, NSArray and the
// Blocks runtime symbols clang emits for metal-cpp's handler blocks.
//
// Environment read here:
//   FAKEMETAL_LEAKS_FATAL=1   objects still alive at exit make the process exit with status 66
//   FAKEMETAL_QUIET_LEAKS=1   no leak report (for processes that deliberately keep a device until exit)
//   FAKEMETAL_ZOMBIE_MB=<n>   memory kept for released objects (default 256): beyond it the oldest are freed
#include "objc.h"

#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_set>

extern "C" {
// clang's constant strings (MTLSTR / CFSTR) on ELF: { &__CFConstantStringClassReference, flags, chars, length }.
__attribute__((visibility("default"))) int __CFConstantStringClassReference[32] = {};

// Blocks: the isa values of stack, global and heap blocks.
__attribute__((visibility("default"))) void* _NSConcreteStackBlock[32] = {};
__attribute__((visibility("default"))) void* _NSConcreteGlobalBlock[32] = {};
__attribute__((visibility("default"))) void* _NSConcreteMallocBlock[32] = {};

void fakemetal_nil_imp();  // msgsend_x86_64.S
}

namespace fakemetal {

namespace {

struct ConstString {  // the layout clang emits for a string literal object
  const void* isa;
  int flags;
  const void* chars;
  long length;
};
constexpr int kConstStringUtf16 = 0x7d0;  // 0x7c8: 8-bit characters; 0x7d0: UTF-16

objc_class g_meta{nullptr, nullptr};    // the isa of every class object
objc_class g_zombie{nullptr, nullptr};  // the isa of every released object

struct Zombie : objc_object {  // what a released object's memory holds (fits in the 64 bytes every object has)
  ClassInfo* was;
  const void* address;
  size_t bytes;  // the object's allocation
};

bool is_const_string(const objc_object* o) {
  return reinterpret_cast<const void*>(o->isa) == static_cast<const void*>(__CFConstantStringClassReference);
}

// Long-lived registries are heap singletons that are never destroyed: the leak report runs from a static
// destructor, after other static objects may be gone.
struct Registry {
  std::recursive_mutex mu;
  std::unordered_map<std::string, std::unique_ptr<char[]>> selectors;
  std::map<std::string, std::unique_ptr<ClassInfo>> classes;
  std::unordered_set<Obj*> live;
  std::deque<Zombie*> zombies;  // kept reachable (leak checkers must not count them), oldest first
  size_t zombie_bytes = 0;
  size_t zombie_budget = 0;  // FAKEMETAL_ZOMBIE_MB (default 256): older zombies are freed beyond it
  std::unordered_map<const void*, std::string> literal_utf8;  // UTF-16 literals converted once
  long autoreleased_without_pool = 0;
};
Registry& reg() {
  static Registry* r = new Registry;
  return *r;
}

std::unordered_map<Obj*, void (*)(Obj*)>& destroyers() {
  static auto* d = new std::unordered_map<Obj*, void (*)(Obj*)>;
  return *d;
}

void ensure_classes();

}  // namespace

void die(const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "fakemetal: %s\n", buf);
  fflush(stderr);
  abort();
}

void warn(const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "fakemetal: warning: %s\n", buf);
}

SEL sel(const char* name) {
  Registry& r = reg();
  std::lock_guard<std::recursive_mutex> lock(r.mu);
  auto it = r.selectors.find(name);
  if (it == r.selectors.end()) {
    const size_t n = strlen(name) + 1;
    std::unique_ptr<char[]> copy(new char[n]);
    memcpy(copy.get(), name, n);
    it = r.selectors.emplace(name, std::move(copy)).first;
  }
  return reinterpret_cast<SEL>(it->second.get());
}

ClassInfo& define_class(const char* name, const char* super_name) {
  Registry& r = reg();
  std::lock_guard<std::recursive_mutex> lock(r.mu);
  auto& slot = r.classes[name];
  if (!slot) {
    slot.reset(new ClassInfo);
    slot->name = name;
    slot->cls.isa = &g_meta;
    slot->cls.info = slot.get();
  }
  if (super_name) slot->super = &define_class(super_name, nullptr);
  return *slot;
}

ClassInfo* find_class(const char* name) {
  ensure_classes();
  Registry& r = reg();
  std::lock_guard<std::recursive_mutex> lock(r.mu);
  auto it = r.classes.find(name);
  return it == r.classes.end() ? nullptr : it->second.get();
}

const char* class_name(const objc_object* o) {
  if (!o) return "nil";
  if (is_const_string(o)) return "__NSCFConstantString";
  if (o->isa == &g_meta) return reinterpret_cast<const objc_class*>(o)->info->name.c_str();
  if (o->isa == &g_zombie) return static_cast<const Zombie*>(o)->was->name.c_str();
  return static_cast<const Obj*>(o)->info->name.c_str();
}

size_t object_bytes(size_t type_size) { return type_size > 64 ? type_size : 64; }

void register_live(Obj* o, ClassInfo& c, void (*destroy)(Obj*)) {
  o->isa = &c.cls;
  o->info = &c;
  Registry& r = reg();
  std::lock_guard<std::recursive_mutex> lock(r.mu);
  r.live.insert(o);
  destroyers()[o] = destroy;
}

bool is_live_object(const objc_object* o) {
  return o && !is_const_string(o) && o->isa != &g_meta && o->isa != &g_zombie;
}

void retain(objc_object* o) {
  if (is_live_object(o)) static_cast<Obj*>(o)->refs.fetch_add(1, std::memory_order_relaxed);
}

void release(objc_object* o) {
  if (!is_live_object(o)) return;
  Obj* obj = static_cast<Obj*>(o);
  const long left = obj->refs.fetch_sub(1, std::memory_order_acq_rel) - 1;
  if (left > 0) return;
  if (left < 0) die("over-release of %s %p", obj->info->name.c_str(), static_cast<void*>(obj));
  Registry& r = reg();
  void (*destroy)(Obj*) = nullptr;
  {
    std::lock_guard<std::recursive_mutex> lock(r.mu);
    r.live.erase(obj);
    auto it = destroyers().find(obj);
    destroy = it->second;
    destroyers().erase(it);
  }
  ClassInfo* was = obj->info;
  const size_t bytes = obj->bytes;
  destroy(obj);  // the C++ destructor releases what the object holds (may release other objects)
  Zombie* z = new (static_cast<void*>(obj)) Zombie;
  z->isa = &g_zombie;
  z->was = was;
  z->address = z;
  z->bytes = bytes;
  std::lock_guard<std::recursive_mutex> lock(r.mu);
  if (r.zombie_budget == 0) {
    const char* mb = getenv("FAKEMETAL_ZOMBIE_MB");
    r.zombie_budget = size_t(mb && atol(mb) > 0 ? atol(mb) : 256) << 20;
  }
  r.zombies.push_back(z);
  r.zombie_bytes += bytes;
  while (r.zombie_bytes > r.zombie_budget && r.zombies.size() > 1) {  // a long run: forget the oldest
    Zombie* old = r.zombies.front();
    r.zombies.pop_front();
    r.zombie_bytes -= old->bytes;
    ::operator delete(static_cast<void*>(old));
  }
}

// ---------------------------------------------------------------------------------------------------------
// Autorelease pools: one stack per thread; draining a pool drains the pools pushed after it first.
// ---------------------------------------------------------------------------------------------------------

namespace {

struct Pool : Obj {
  std::vector<objc_object*> items;
  bool pushed = false;
};
thread_local std::vector<Pool*> t_pools;

void drain_items(Pool* p) {
  while (!p->items.empty()) {  // releasing may autorelease more objects into this pool
    std::vector<objc_object*> batch;
    batch.swap(p->items);
    for (objc_object* o : batch) release(o);
  }
}

void drain_pool(Pool* p) {
  if (p->pushed) {
    size_t at = t_pools.size();
    while (at > 0 && t_pools[at - 1] != p) --at;
    if (at == 0) die("NSAutoreleasePool %p drained on a thread that did not create it", static_cast<void*>(p));
    while (t_pools.size() > at) {  // nested pools left undrained
      Pool* top = t_pools.back();
      drain_items(top);
      t_pools.pop_back();
      top->pushed = false;
      if (top != p) release(top);
    }
  }
  drain_items(p);
  p->pushed = false;
}

}  // namespace

objc_object* autorelease(objc_object* o) {
  if (!is_live_object(o)) return o;
  if (t_pools.empty()) {
    Registry& r = reg();
    std::lock_guard<std::recursive_mutex> lock(r.mu);
    if (r.autoreleased_without_pool++ == 0)
      warn("%s %p autoreleased with no autorelease pool in place: it leaks", class_name(o), static_cast<void*>(o));
    return o;
  }
  t_pools.back()->items.push_back(o);
  return o;
}

// ---------------------------------------------------------------------------------------------------------
// Foundation classes
// ---------------------------------------------------------------------------------------------------------

namespace {

struct String : Obj {
  std::string text;
};

struct Error : Obj {
  objc_object* domain = nullptr;       // NSString, held
  long code = 0;
  objc_object* description = nullptr;  // NSString, held
  ~Error() {
    release(domain);
    release(description);
  }
};

struct Array : Obj {
  std::vector<objc_object*> items;
  ~Array() {
    for (objc_object* o : items) release(o);
  }
};

ClassInfo* g_string_class = nullptr;
ClassInfo* g_const_string_class = nullptr;

std::string utf16_to_utf8(const uint16_t* s, long n) {
  std::string out;
  for (long i = 0; i < n; ++i) {
    uint32_t c = s[i];
    if (c >= 0xD800 && c < 0xDC00 && i + 1 < n) c = 0x10000 + ((c - 0xD800) << 10) + (s[++i] - 0xDC00);
    if (c < 0x80) {
      out += char(c);
    } else if (c < 0x800) {
      out += char(0xC0 | (c >> 6));
      out += char(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      out += char(0xE0 | (c >> 12));
      out += char(0x80 | ((c >> 6) & 0x3F));
      out += char(0x80 | (c & 0x3F));
    } else {
      out += char(0xF0 | (c >> 18));
      out += char(0x80 | ((c >> 12) & 0x3F));
      out += char(0x80 | ((c >> 6) & 0x3F));
      out += char(0x80 | (c & 0x3F));
    }
  }
  return out;
}

// The UTF-8 text of a string object; the pointer lives as long as the object (literals: forever).
const std::string& text_of(const objc_object* s) {
  if (is_const_string(s)) {
    const auto* c = reinterpret_cast<const ConstString*>(s);
    Registry& r = reg();
    std::lock_guard<std::recursive_mutex> lock(r.mu);
    auto it = r.literal_utf8.find(s);
    if (it == r.literal_utf8.end()) {
      std::string t = c->flags == kConstStringUtf16
                          ? utf16_to_utf8(static_cast<const uint16_t*>(c->chars), c->length)
                          : std::string(static_cast<const char*>(c->chars), size_t(c->length));
      it = r.literal_utf8.emplace(s, std::move(t)).first;
    }
    return it->second;
  }
  const Obj* o = static_cast<const Obj*>(s);
  if (o->info != g_string_class) die("-[%s UTF8String]: not a string", o->info->name.c_str());
  return static_cast<const String*>(o)->text;
}

objc_object* new_string_object() { return new_object<String>(*g_string_class); }

// NSObject
objc_object* obj_retain(objc_object* self, SEL) {
  retain(self);
  return self;
}
void obj_release(objc_object* self, SEL) { release(self); }
objc_object* obj_autorelease(objc_object* self, SEL) { return autorelease(self); }
unsigned long obj_retain_count(objc_object* self, SEL) {
  return is_live_object(self) ? static_cast<unsigned long>(static_cast<Obj*>(self)->refs.load()) : ~0ul;
}
objc_object* obj_init(objc_object* self, SEL) { return self; }
unsigned long obj_hash(objc_object* self, SEL) { return reinterpret_cast<uintptr_t>(self); }
bool obj_is_equal(objc_object* self, SEL, objc_object* other) { return self == other; }
objc_object* obj_description(objc_object* self, SEL) {
  char buf[256];
  snprintf(buf, sizeof buf, "<%s: %p>", class_name(self), static_cast<void*>(self));
  return autorelease(make_string(buf));
}
bool lookup_method(ClassInfo* c, SEL s, bool class_side, Imp* out);
bool obj_responds(objc_object* self, SEL, SEL query) {
  Imp imp;
  const ClassInfo* c = is_const_string(self) ? g_const_string_class : static_cast<Obj*>(self)->info;
  return lookup_method(const_cast<ClassInfo*>(c), query, false, &imp);
}
objc_object* obj_class(objc_object* self, SEL) {
  if (is_const_string(self)) return reinterpret_cast<objc_object*>(&g_const_string_class->cls);
  return reinterpret_cast<objc_object*>(&static_cast<Obj*>(self)->info->cls);
}

// class side
objc_object* cls_alloc(objc_class* cls, SEL) {
  if (!cls->info->make)
    die("+[%s alloc]: the fake runtime cannot make instances of this class", cls->info->name.c_str());
  return cls->info->make();
}
objc_object* cls_new(objc_class* cls, SEL) {
  objc_object* o = cls_alloc(cls, nullptr);
  Imp init;
  if (lookup_method(cls->info, sel("init"), false, &init))
    return reinterpret_cast<objc_object* (*)(objc_object*, SEL)>(init)(o, sel("init"));
  return o;
}
objc_object* cls_self(objc_class* cls, SEL) { return reinterpret_cast<objc_object*>(cls); }
bool cls_instances_respond(objc_class* cls, SEL, SEL query) {
  Imp imp;
  return lookup_method(cls->info, query, false, &imp);
}

// NSString
objc_object* str_with_cstring(objc_class*, SEL, const char* s, unsigned long) {
  return autorelease(make_string(s ? s : ""));
}
objc_object* str_with_string(objc_class*, SEL, objc_object* s) { return autorelease(make_string(string_value(s))); }
objc_object* str_empty(objc_class*, SEL) { return autorelease(make_string("")); }
objc_object* str_init_cstring(objc_object* self, SEL, const char* s, unsigned long) {
  static_cast<String*>(static_cast<Obj*>(self))->text = s ? s : "";
  return self;
}
objc_object* str_init_string(objc_object* self, SEL, objc_object* s) {
  static_cast<String*>(static_cast<Obj*>(self))->text = string_value(s);
  return self;
}
const char* str_utf8(objc_object* self, SEL) { return text_of(self).c_str(); }
const char* str_cstring(objc_object* self, SEL, unsigned long) { return text_of(self).c_str(); }
unsigned long str_length(objc_object* self, SEL) {
  unsigned long n = 0;  // UTF-16 code units, as NSString counts
  for (unsigned char c : text_of(self)) n += (c & 0xC0) != 0x80 ? ((c >= 0xF0) ? 2 : 1) : 0;
  return n;
}
unsigned long str_bytes_length(objc_object* self, SEL, unsigned long) { return text_of(self).size(); }
bool str_equal(objc_object* self, SEL, objc_object* other) { return other && text_of(self) == text_of(other); }
bool str_is_equal(objc_object* self, SEL, objc_object* other) {
  return other && (is_const_string(other) || static_cast<Obj*>(other)->info == g_string_class) &&
         text_of(self) == text_of(other);
}
unsigned long str_hash(objc_object* self, SEL) { return std::hash<std::string>()(text_of(self)); }
objc_object* str_append(objc_object* self, SEL, objc_object* other) {
  return autorelease(make_string(text_of(self) + string_value(other)));
}
objc_object* str_copy(objc_object* self, SEL) {  // immutable: a copy is the same object
  retain(self);
  return self;
}
objc_object* str_description(objc_object* self, SEL) { return self; }
objc_object* const_noop(objc_object* self, SEL) { return self; }
void const_release(objc_object*, SEL) {}

// NSError
objc_object* err_make(objc_class*, SEL, objc_object* domain, long code, objc_object*) {
  return autorelease(make_error(string_value(domain).c_str(), code, "error " + std::to_string(code)));
}
objc_object* err_init(objc_object* self, SEL, objc_object* domain, long code, objc_object*) {
  Error* e = static_cast<Error*>(static_cast<Obj*>(self));
  e->domain = make_string(string_value(domain));
  e->code = code;
  e->description = make_string(string_value(domain) + " error " + std::to_string(code));
  return self;
}
long err_code(objc_object* self, SEL) { return static_cast<Error*>(static_cast<Obj*>(self))->code; }
objc_object* err_domain(objc_object* self, SEL) { return static_cast<Error*>(static_cast<Obj*>(self))->domain; }
objc_object* err_description(objc_object* self, SEL) {
  return static_cast<Error*>(static_cast<Obj*>(self))->description;
}
objc_object* ret_nil(objc_object*, SEL) { return nullptr; }

// NSArray
unsigned long arr_count(objc_object* self, SEL) { return static_cast<Array*>(static_cast<Obj*>(self))->items.size(); }
objc_object* arr_at(objc_object* self, SEL, unsigned long i) {
  auto& items = static_cast<Array*>(static_cast<Obj*>(self))->items;
  if (i >= items.size()) die("-[NSArray objectAtIndex:]: index %lu beyond bounds [0 .. %zu)", i, items.size());
  return items[i];
}
objc_object* arr_empty(objc_class*, SEL) { return autorelease(make_array({})); }
objc_object* arr_with_object(objc_class*, SEL, objc_object* o) { return autorelease(make_array({o})); }
objc_object* arr_with_objects(objc_class*, SEL, objc_object* const* objs, unsigned long n) {
  return autorelease(make_array(std::vector<objc_object*>(objs, objs + n)));
}

// NSAutoreleasePool
objc_object* pool_init(objc_object* self, SEL) {
  Pool* p = static_cast<Pool*>(static_cast<Obj*>(self));
  p->pushed = true;
  t_pools.push_back(p);
  return self;
}
void pool_drain(objc_object* self, SEL) {
  drain_pool(static_cast<Pool*>(static_cast<Obj*>(self)));
  release(self);
}
void pool_release(objc_object* self, SEL) { pool_drain(self, nullptr); }
objc_object* pool_retain(objc_object* self, SEL) {
  die("-[NSAutoreleasePool retain]: an autorelease pool cannot be retained (%p)", static_cast<void*>(self));
}
void pool_add_object(objc_object* self, SEL, objc_object* o) {
  static_cast<Pool*>(static_cast<Obj*>(self))->items.push_back(o);
}
void pool_class_add_object(objc_class*, SEL, objc_object* o) { autorelease(o); }
void pool_show(objc_class*, SEL) {
  fprintf(stderr, "fakemetal: %zu autorelease pools on this thread\n", t_pools.size());
  for (size_t i = 0; i < t_pools.size(); ++i)
    fprintf(stderr, "  pool %zu: %zu objects\n", i, t_pools[i]->items.size());
}

void register_foundation() {
  ClassInfo& o = define_class("NSObject", nullptr);
  def(o, "retain", &obj_retain);
  def(o, "release", &obj_release);
  def(o, "autorelease", &obj_autorelease);
  def(o, "retainCount", &obj_retain_count);
  def(o, "init", &obj_init);
  def(o, "hash", &obj_hash);
  def(o, "isEqual:", &obj_is_equal);
  def(o, "description", &obj_description);
  def(o, "debugDescription", &obj_description);
  def(o, "respondsToSelector:", &obj_responds);
  def(o, "class", &obj_class);
  def_class(o, "alloc", &cls_alloc);
  def_class(o, "new", &cls_new);
  def_class(o, "class", &cls_self);
  def_class(o, "retain", &cls_self);  // class objects live forever: reference counting is a no-op
  def_class(o, "autorelease", &cls_self);
  def_class(o, "release", +[](objc_class*, SEL) {});
  def_class(o, "instancesRespondToSelector:", &cls_instances_respond);

  ClassInfo& s = define_class("NSString", "NSObject");
  g_string_class = &s;
  s.make = &new_string_object;
  def_class(s, "string", &str_empty);
  def_class(s, "stringWithString:", &str_with_string);
  def_class(s, "stringWithCString:encoding:", &str_with_cstring);
  def_class(s, "stringWithUTF8String:", +[](objc_class* c, SEL, const char* t) {
    return str_with_cstring(c, nullptr, t, 4);
  });
  def(s, "initWithCString:encoding:", &str_init_cstring);
  def(s, "initWithUTF8String:", +[](objc_object* self, SEL, const char* t) {
    return str_init_cstring(self, nullptr, t, 4);
  });
  def(s, "initWithString:", &str_init_string);
  def(s, "UTF8String", &str_utf8);
  def(s, "cStringUsingEncoding:", &str_cstring);
  def(s, "fileSystemRepresentation", &str_utf8);
  def(s, "length", &str_length);
  def(s, "lengthOfBytesUsingEncoding:", &str_bytes_length);
  def(s, "maximumLengthOfBytesUsingEncoding:", +[](objc_object* self, SEL, unsigned long) {
    return 3 * text_of(self).size();
  });
  def(s, "isEqualToString:", &str_equal);
  def(s, "isEqual:", &str_is_equal);
  def(s, "hash", &str_hash);
  def(s, "stringByAppendingString:", &str_append);
  def(s, "copy", &str_copy);
  def(s, "description", &str_description);

  ClassInfo& cs = define_class("__NSCFConstantString", "NSString");
  g_const_string_class = &cs;
  def(cs, "retain", &const_noop);
  def(cs, "autorelease", &const_noop);
  def(cs, "copy", &const_noop);
  def(cs, "release", &const_release);

  ClassInfo& e = define_class("NSError", "NSObject");
  e.make = +[]() -> objc_object* { return new_object<Error>(*find_class("NSError")); };
  def_class(e, "errorWithDomain:code:userInfo:", &err_make);
  def(e, "initWithDomain:code:userInfo:", &err_init);
  def(e, "code", &err_code);
  def(e, "domain", &err_domain);
  def(e, "localizedDescription", &err_description);
  def(e, "description", &err_description);
  def(e, "userInfo", &ret_nil);
  def(e, "localizedFailureReason", &ret_nil);
  def(e, "localizedRecoverySuggestion", &ret_nil);
  def(e, "localizedRecoveryOptions", &ret_nil);

  ClassInfo& a = define_class("NSArray", "NSObject");
  a.make = +[]() -> objc_object* { return new_object<Array>(*find_class("NSArray")); };
  def_class(a, "array", &arr_empty);
  def_class(a, "arrayWithObject:", &arr_with_object);
  def_class(a, "arrayWithObjects:count:", &arr_with_objects);
  def(a, "count", &arr_count);
  def(a, "objectAtIndex:", &arr_at);

  ClassInfo& p = define_class("NSAutoreleasePool", "NSObject");
  p.make = +[]() -> objc_object* { return new_object<Pool>(*find_class("NSAutoreleasePool")); };
  def(p, "init", &pool_init);
  def(p, "drain", &pool_drain);
  def(p, "release", &pool_release);
  def(p, "retain", &pool_retain);
  def(p, "autorelease", &pool_retain);
  def(p, "addObject:", &pool_add_object);
  def_class(p, "addObject:", &pool_class_add_object);
  def_class(p, "showPools", &pool_show);
}

void ensure_classes() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_foundation();
    register_metal_classes();
  });
}

bool lookup_method(ClassInfo* c, SEL s, bool class_side, Imp* out) {
  for (; c; c = c->super) {
    auto& table = class_side ? c->class_methods : c->methods;
    auto it = table.find(s);
    if (it != table.end()) {
      *out = it->second;
      return true;
    }
  }
  return false;
}

}  // namespace

objc_object* make_string(const std::string& utf8) {
  ensure_classes();
  String* s = new_object<String>(*g_string_class);
  s->text = utf8;
  return s;
}

std::string string_value(const objc_object* s) { return s ? text_of(s) : std::string(); }

objc_object* make_error(const char* domain, long code, const std::string& description) {
  ensure_classes();
  Error* e = new_object<Error>(*find_class("NSError"));
  e->domain = make_string(domain);
  e->code = code;
  e->description = make_string(description);
  return e;
}

objc_object* make_array(const std::vector<objc_object*>& items) {
  ensure_classes();
  Array* a = new_object<Array>(*find_class("NSArray"));
  for (objc_object* o : items) retain(o);
  a->items = items;
  return a;
}

// ---------------------------------------------------------------------------------------------------------
// Blocks runtime (the subset metal-cpp's handler blocks need)
// ---------------------------------------------------------------------------------------------------------

namespace {
constexpr int kBlockRefcountMask = 0xfffe;
constexpr int kBlockNeedsFree = 1 << 24;
constexpr int kBlockHasCopyDispose = 1 << 25;
constexpr int kBlockIsGlobal = 1 << 28;
struct BlockDescriptor {
  unsigned long reserved;
  unsigned long size;
  void (*copy)(void* dst, const void* src);  // present when kBlockHasCopyDispose
  void (*dispose)(const void*);
};
}  // namespace

void* block_copy(const void* block) {
  if (!block) return nullptr;
  auto* b = static_cast<BlockLayout*>(const_cast<void*>(block));
  if (b->flags & kBlockIsGlobal) return b;
  if (b->flags & kBlockNeedsFree) {
    __atomic_add_fetch(&b->flags, 2, __ATOMIC_RELAXED);
    return b;
  }
  const auto* d = static_cast<const BlockDescriptor*>(b->descriptor);
  auto* copy = static_cast<BlockLayout*>(malloc(d->size));
  memcpy(copy, b, d->size);
  copy->isa = _NSConcreteMallocBlock;
  copy->flags = (b->flags & ~kBlockRefcountMask) | kBlockNeedsFree | 2;
  if (b->flags & kBlockHasCopyDispose) d->copy(copy, b);
  return copy;
}

void block_release(const void* block) {
  if (!block) return;
  auto* b = static_cast<BlockLayout*>(const_cast<void*>(block));
  if (!(b->flags & kBlockNeedsFree)) return;
  if ((__atomic_sub_fetch(&b->flags, 2, __ATOMIC_ACQ_REL) & kBlockRefcountMask) != 0) return;
  const auto* d = static_cast<const BlockDescriptor*>(b->descriptor);
  if (b->flags & kBlockHasCopyDispose) d->dispose(b);
  free(b);
}

namespace {
constexpr int kFieldIsObject = 3, kFieldIsBlock = 7, kFieldIsByref = 8, kFieldIsWeak = 16, kByrefCaller = 128;
constexpr int kBlockAllCopyDisposeFlags = kFieldIsObject | kFieldIsBlock | kFieldIsByref | kFieldIsWeak | kByrefCaller;
constexpr int kByrefLayoutExtended = 1 << 28;
struct Byref {  // a __block variable: header, then (with copy/dispose) keep/destroy, then the variable
  void* isa;
  Byref* forwarding;
  int flags;  // refcount in kBlockRefcountMask, kBlockNeedsFree, kBlockHasCopyDispose
  unsigned size;
};
struct ByrefHelpers {
  void (*keep)(Byref* dst, Byref* src);
  void (*destroy)(Byref*);
};

// Moves a stack __block variable to the heap (two references: the copying block and the stack frame, which
// drops its one with _Block_object_dispose when the variable goes out of scope); later copies share it.
void* byref_copy(const void* arg) {
  auto* src = static_cast<Byref*>(const_cast<void*>(arg));
  if ((src->forwarding->flags & kBlockRefcountMask) == 0) {
    auto* copy = static_cast<Byref*>(malloc(src->size));
    copy->isa = nullptr;
    copy->flags = src->flags | kBlockNeedsFree | 4;
    copy->forwarding = copy;
    src->forwarding = copy;
    copy->size = src->size;
    if (src->flags & kBlockHasCopyDispose) {
      auto* s2 = reinterpret_cast<ByrefHelpers*>(src + 1);
      auto* c2 = reinterpret_cast<ByrefHelpers*>(copy + 1);
      *c2 = *s2;
      if (src->flags & kByrefLayoutExtended)
        *reinterpret_cast<const void**>(c2 + 1) = *reinterpret_cast<const void**>(s2 + 1);
      s2->keep(copy, src);  // copy-constructs the variable (a C++ object) into the heap copy
    } else {
      memmove(copy + 1, src + 1, src->size - sizeof(Byref));
    }
  } else if (src->forwarding->flags & kBlockNeedsFree) {
    __atomic_add_fetch(&src->forwarding->flags, 2, __ATOMIC_RELAXED);
  }
  return src->forwarding;
}

void byref_release(const void* arg) {
  Byref* b = static_cast<const Byref*>(arg)->forwarding;
  if (!(b->flags & kBlockNeedsFree)) return;  // still on the stack: nothing to free
  if ((__atomic_sub_fetch(&b->flags, 2, __ATOMIC_ACQ_REL) & kBlockRefcountMask) != 0) return;
  if (b->flags & kBlockHasCopyDispose) reinterpret_cast<ByrefHelpers*>(b + 1)->destroy(b);
  free(b);
}
}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Exit report
// ---------------------------------------------------------------------------------------------------------

void (*g_before_exit_report)() = nullptr;

namespace {
struct ExitReport {
  ~ExitReport() {
    if (g_before_exit_report) g_before_exit_report();
    const char* quiet = getenv("FAKEMETAL_QUIET_LEAKS");
    if (quiet && *quiet == '1') return;
    Registry& r = reg();
    std::lock_guard<std::recursive_mutex> lock(r.mu);
    if (r.live.empty()) return;
    std::map<std::string, long> by_class;
    for (Obj* o : r.live) ++by_class[o->info->name];
    std::string list;
    for (auto& [name, n] : by_class) list += "  " + name + " x" + std::to_string(n) + "\n";
    fprintf(stderr, "fakemetal: %zu objects leaked (still alive at exit):\n%s", r.live.size(), list.c_str());
    fflush(stderr);
    const char* fatal = getenv("FAKEMETAL_LEAKS_FATAL");
    if (fatal && *fatal == '1') _exit(66);
  }
} g_exit_report;
}  // namespace

}  // namespace fakemetal

using namespace fakemetal;

extern "C" {

__attribute__((visibility("default"))) Class objc_lookUpClass(const char* name) {
  ClassInfo* c = find_class(name);
  return c ? &c->cls : nullptr;
}

__attribute__((visibility("default"))) Protocol* objc_getProtocol(const char*) { return nullptr; }

__attribute__((visibility("default"))) SEL sel_registerName(const char* name) { return sel(name); }

__attribute__((visibility("default"))) const char* sel_getName(SEL s) { return reinterpret_cast<const char*>(s); }

__attribute__((visibility("default"))) const char* class_getName(Class c) {
  return c ? c->info->name.c_str() : "nil";
}

__attribute__((visibility("default"))) Class object_getClass(id o) {
  if (!o) return nullptr;
  if (is_const_string(o)) return &g_const_string_class->cls;
  if (o->isa == &g_meta || o->isa == &g_zombie) return o->isa;
  return &static_cast<Obj*>(o)->info->cls;
}

// Called by the objc_msgSend trampolines: the implementation of sel for self, or a fatal error.
__attribute__((visibility("hidden"))) void* fakemetal_lookup(objc_object* self, SEL s) {
  if (!self) return reinterpret_cast<void*>(&fakemetal_nil_imp);
  ensure_classes();
  Imp imp = nullptr;
  const char* name = reinterpret_cast<const char*>(s);
  if (self->isa == &g_meta) {
    ClassInfo* c = reinterpret_cast<objc_class*>(self)->info;
    if (lookup_method(c, s, true, &imp)) return imp;
    die("+[%s %s]: unrecognized selector (the fake Metal runtime does not implement it)", c->name.c_str(), name);
  }
  if (self->isa == &g_zombie) {
    const Zombie* z = static_cast<const Zombie*>(self);
    die("use-after-release: -[%s %s] sent to released object %p", z->was->name.c_str(), name, z->address);
  }
  ClassInfo* c;
  if (is_const_string(self)) {
    c = g_const_string_class;
  } else {
    if (!self->isa || self->isa->isa != &g_meta)
      die("-[? %s] sent to %p, which is not an object of the fake runtime (a stale or garbage pointer)", name,
          static_cast<void*>(self));
    c = static_cast<Obj*>(self)->info;
  }
  if (lookup_method(c, s, false, &imp)) return imp;
  die("-[%s %s]: unrecognized selector (the fake Metal runtime does not implement it)", c->name.c_str(), name);
}

__attribute__((visibility("default"))) void* _Block_copy(const void* block) { return block_copy(block); }
__attribute__((visibility("default"))) void _Block_release(const void* block) { block_release(block); }

// Captured variables of copied blocks (Apple's Blocks ABI). Objects (3) are kept as plain pointers (no ARC
// here), blocks (7) are copied, __block variables (8) move to the heap on the first copy: metal-cpp keeps its
// std::function handlers in __block variables (MTLCommandBuffer.hpp addCompletedHandler).
__attribute__((visibility("default"))) void _Block_object_assign(void* dst, const void* src, int flags) {
  switch (flags & kBlockAllCopyDisposeFlags) {
    case kFieldIsObject: *static_cast<const void**>(dst) = src; return;
    case kFieldIsBlock: *static_cast<void**>(dst) = block_copy(src); return;
    case kFieldIsByref:
    case kFieldIsByref | kFieldIsWeak: *static_cast<void**>(dst) = byref_copy(src); return;
    default: *static_cast<const void**>(dst) = src; return;  // byref-caller forms: the variable's own fields
  }
}
__attribute__((visibility("default"))) void _Block_object_dispose(const void* obj, int flags) {
  switch (flags & kBlockAllCopyDisposeFlags) {
    case kFieldIsByref:
    case kFieldIsByref | kFieldIsWeak: byref_release(obj); return;
    case kFieldIsBlock: block_release(obj); return;
    default: return;
  }
}

}  // extern "C"
