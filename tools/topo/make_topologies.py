#!/usr/bin/env python3
"""Regenerate the synthetic hwloc 2.x XML topologies in tests/data/topo/ (GPU NUMA-placement tests).

Run from the repository root:  python3 tools/topo/make_topologies.py
Needs hwloc's `lstopo` (2.x) on PATH. For each topology, lstopo builds the CPU/NUMA
part from a synthetic description and exports it as XML; this script then hangs PCI
objects below the chosen parent (Machine, a Package, or the Group holding one NUMA node):

    Bridge (host bridge, bridge_type 0-1, depth 0, bridge_pci DDDD:[S-max])
      Bridge (PCI-PCI bridge on bus S, bridge_type 1-1, depth 1, bridge_pci DDDD:[B-B])
        PCIDev (the GPU, DDDD:B:00.0, class 0302 3D controller, 10de:2335)

one host bridge per parent, one PCI bridge per GPU. Output is deterministic for a
given hwloc version (the only version-dependent text is the hwlocVersion info).
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

OUT_DIR = os.path.join("tests", "data", "topo")

GPU_VENDOR, GPU_DEVICE = 0x10DE, 0x2335        # NVIDIA H200
GPU_SUBSYS = (0x10DE, 0x0000)                  # illustrative subsystem ids
GPU_CLASS = 0x0302                             # 3D controller
GPU_LINK = "63.015385"                         # GB/s: PCIe gen5 x16
BRIDGE_VENDOR, BRIDGE_DEVICE = 0x1000, 0xC010  # illustrative PCIe switch port ids
BRIDGE_CLASS = 0x0604                          # PCI-to-PCI bridge


def pu_indexes_smt(packages, cores_per_package, threads):
    """Linux-style PU numbering: thread t of global core c gets c + t * total_cores."""
    total = packages * cores_per_package
    return [c + t * total for c in range(total) for t in range(threads)]


# Each topology: synthetic description, then a list of (parent selector, [bus ids]).
# Selectors: ("Machine",), ("Package", os_index), ("NUMAGroup", numa os_index).
TOPOLOGIES = [
    (
        "dgx_2socket_8gpu.xml",
        "pack:2 [numa(memory=1TiB)] core:16 pu:2(indexes=%s)"
        % ",".join(str(i) for i in pu_indexes_smt(2, 16, 2)),
        [
            (("Package", 0), ["0000:19:00.0", "0000:3b:00.0", "0000:4c:00.0", "0000:5d:00.0"]),
            (("Package", 1), ["0000:9b:00.0", "0000:bb:00.0", "0000:cb:00.0", "0000:db:00.0"]),
        ],
    ),
    (
        "one_socket_4gpu.xml",
        "pack:1 [numa(memory=256GiB)] core:8 pu:1",
        [(("Package", 0), ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0", "0000:04:00.0"])],
    ),
    (
        "snc_2socket_4numa_8gpu.xml",
        "pack:2 group:2 [numa(memory=256GiB)] core:8 pu:1",
        [
            (("NUMAGroup", 0), ["0000:18:00.0", "0000:2a:00.0"]),
            (("NUMAGroup", 1), ["0000:3a:00.0", "0000:5d:00.0"]),
            (("NUMAGroup", 2), ["0000:98:00.0", "0000:aa:00.0"]),
            (("NUMAGroup", 3), ["0000:ba:00.0", "0000:db:00.0"]),
        ],
    ),
    (
        "gpu_without_numa.xml",
        "pack:2 [numa(memory=128GiB)] core:4 pu:1",
        [(("Machine",), ["0000:81:00.0", "0000:82:00.0"])],
    ),
    (
        "tiny_2core_8gpu.xml",
        "pack:1 [numa(memory=64GiB)] core:2 pu:1",
        [(("Package", 0), ["0000:%02x:00.0" % b for b in range(0x10, 0x18)])],
    ),
]


def lstopo_xml(desc):
    res = subprocess.run(
        ["lstopo", "--input", desc, "--of", "xml", "-"],
        check=True, capture_output=True, text=True,
    )
    if res.stderr.strip():
        sys.exit("lstopo complained about %r:\n%s" % (desc, res.stderr))
    return ET.fromstring(res.stdout)


def find_parent(root, sel):
    machine = root.find("object")
    assert machine is not None and machine.get("type") == "Machine"
    if sel[0] == "Machine":
        return machine
    for obj in machine.iter("object"):
        if sel[0] == "Package" and obj.get("type") == "Package" \
                and obj.get("os_index") == str(sel[1]):
            return obj
        if sel[0] == "NUMAGroup" and obj.get("type") == "Group":
            for child in obj.findall("object"):
                if child.get("type") == "NUMANode" and child.get("os_index") == str(sel[1]):
                    return obj
    sys.exit("no parent object for selector %r" % (sel,))


def parse_busid(busid):
    dom, bus, devfn = busid.split(":")
    dev, fn = devfn.split(".")
    return int(dom, 16), int(bus, 16), int(dev, 16), int(fn, 16)


def pci_type(cls, vendor, device, subsys, rev):
    return "%04x [%04x:%04x] [%04x:%04x] %02x" % (cls, vendor, device, subsys[0], subsys[1], rev)


def add_gpus(parent, busids, next_gp):
    """Append one host bridge with a PCI bridge + GPU per bus id; return the next free gp_index."""
    parsed = sorted(parse_busid(b) for b in busids)
    domain = parsed[0][0]
    assert all(p[0] == domain for p in parsed), "one PCI domain per parent"
    root_bus = parsed[0][1] - 1
    assert root_bus >= 0 and root_bus not in [p[1] for p in parsed]
    host = ET.SubElement(parent, "object", {
        "type": "Bridge", "gp_index": str(next_gp), "bridge_type": "0-1", "depth": "0",
        "bridge_pci": "%04x:[%02x-%02x]" % (domain, root_bus, parsed[-1][1]),
    })
    next_gp += 1
    for slot, (dom, bus, dev, fn) in enumerate(parsed, start=1):
        bridge = ET.SubElement(host, "object", {
            "type": "Bridge", "gp_index": str(next_gp), "bridge_type": "1-1", "depth": "1",
            "bridge_pci": "%04x:[%02x-%02x]" % (dom, bus, bus),
            "pci_busid": "%04x:%02x:%02x.%01x" % (dom, root_bus, slot, 0),
            "pci_type": pci_type(BRIDGE_CLASS, BRIDGE_VENDOR, BRIDGE_DEVICE, (0, 0), 0),
            "pci_link_speed": GPU_LINK,
        })
        next_gp += 1
        gpu = ET.SubElement(bridge, "object", {
            "type": "PCIDev", "gp_index": str(next_gp),
            "pci_busid": "%04x:%02x:%02x.%01x" % (dom, bus, dev, fn),
            "pci_type": pci_type(GPU_CLASS, GPU_VENDOR, GPU_DEVICE, GPU_SUBSYS, 0xA1),
            "pci_link_speed": GPU_LINK,
        })
        next_gp += 1
        ET.SubElement(gpu, "info", {"name": "PCIVendor", "value": "NVIDIA Corporation"})
        ET.SubElement(gpu, "info", {"name": "PCIDevice", "value": "H200 (synthetic)"})
    return next_gp


def build(desc, placements):
    root = lstopo_xml(desc)
    next_gp = 1 + max(int(o.get("gp_index", "0")) for o in root.iter("object"))
    for sel, busids in placements:
        next_gp = add_gpus(find_parent(root, sel), busids, next_gp)
    ET.indent(root, space="  ")
    body = ET.tostring(root, encoding="unicode").replace(" />", "/>")
    return ('<?xml version="1.0" encoding="UTF-8"?>\n'
            '<!DOCTYPE topology SYSTEM "hwloc2.dtd">\n' + body + "\n")


def main():
    if not os.path.isdir(OUT_DIR):
        sys.exit("run from the repository root (no %s here)" % OUT_DIR)
    for name, desc, placements in TOPOLOGIES:
        path = os.path.join(OUT_DIR, name)
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(build(desc, placements))
        print("wrote", path)


if __name__ == "__main__":
    main()
