// A MemoryReport (GradientManager::memory(), plan_memory) as the dict Python sees:
// {"kinds": {"<kind>" host or "<kind>@device": {"device", "bytes", "peak"}}, "host_bytes",
// "host_peak", "device_bytes", "device_peak"}.
#pragma once

#include <nanobind/nanobind.h>

#include "stepcore/managers.hpp"

inline nanobind::dict memory_dict(const stepcore::MemoryReport& r) {
  nanobind::dict kinds;
  for (const stepcore::MemoryUse& k : r.kinds) {
    nanobind::dict e;
    e["device"] = k.device;
    e["bytes"] = k.bytes;
    e["peak"] = k.peak;
    kinds[(k.kind + (k.device ? "@device" : "")).c_str()] = e;
  }
  nanobind::dict d;
  d["kinds"] = kinds;
  d["host_bytes"] = r.host_bytes;
  d["host_peak"] = r.host_peak;
  d["device_bytes"] = r.device_bytes;
  d["device_peak"] = r.device_peak;
  return d;
}
