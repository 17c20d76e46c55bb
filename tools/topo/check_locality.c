/* Print the NUMA locality of each GPU (PCI class 0x0302) in an hwloc XML topology.
 *
 * Build: cc -O2 -Wall -Wextra -o check_locality tools/topo/check_locality.c -lhwloc
 * Usage: check_locality [--filter all|important|none|default] FILE.xml [BUSID...]
 *   --filter: I/O type filter passed to hwloc_topology_set_io_types_filter() (default
 *   here: all); "default" skips that call, showing that hwloc then drops the GPUs.
 *   With bus ids (e.g. 0000:19:00.0), only those devices are looked up (exit 1 if one
 *   is missing); without, every 3D-controller PCI device in the file is listed.
 * One line per GPU:
 *   BUSID parent=TYPE:L#l[:P#p] local_numa=OS,..|- nodeset=LIST nodeN_pus=LIST ...
 *   local_numa: nodes whose locality is exactly the GPU's CPU parent (flags 0);
 *               "-" when none (e.g. the host bridge hangs below Machine).
 *   nodeset:    os indexes of all nodes under the GPU's CPU parent; the nodeN_pus
 *               fields give the PU os indexes of each of those nodes' cpusets.
 */
#include <hwloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void print_obj(hwloc_obj_t obj)
{
    char type[64];
    hwloc_obj_type_snprintf(type, sizeof type, obj, 0);
    printf("%s:L#%u", type, obj->logical_index);
    if (obj->os_index != HWLOC_UNKNOWN_INDEX)
        printf(":P#%u", obj->os_index);
}

static int report(hwloc_topology_t topo, const char *busid)
{
    hwloc_obj_t dev = hwloc_get_pcidev_by_busidstring(topo, busid);
    if (!dev) {
        printf("%s not-found\n", busid);
        return 1;
    }
    hwloc_obj_t parent = hwloc_get_non_io_ancestor_obj(topo, dev);
    printf("%s parent=", busid);
    print_obj(parent);

    /* NUMA nodes whose locality equals the GPU's CPU parent exactly. */
    unsigned total = (unsigned)hwloc_bitmap_weight(hwloc_get_root_obj(topo)->nodeset);
    hwloc_obj_t *nodes = calloc(total ? total : 1, sizeof *nodes);
    unsigned nr = total;
    struct hwloc_location loc;
    loc.type = HWLOC_LOCATION_TYPE_OBJECT;
    loc.location.object = dev; /* an I/O object: its CPU parent is used */
    if (!nodes || hwloc_get_local_numanode_objs(topo, &loc, &nr, nodes, 0) < 0) {
        perror("hwloc_get_local_numanode_objs");
        exit(2);
    }
    printf(" local_numa=");
    if (nr == 0)
        printf("-");
    for (unsigned i = 0; i < nr && i < total; i++)
        printf("%s%u", i ? "," : "", nodes[i]->os_index);
    free(nodes);

    /* All nodes below the CPU parent, with their PUs. */
    char *list = NULL;
    hwloc_bitmap_list_asprintf(&list, parent->nodeset);
    printf(" nodeset=%s", list);
    free(list);
    unsigned os;
    hwloc_bitmap_foreach_begin(os, parent->nodeset) {
        hwloc_obj_t node = hwloc_get_numanode_obj_by_os_index(topo, os);
        hwloc_bitmap_list_asprintf(&list, node->cpuset);
        printf(" node%u_pus=%s", os, list);
        free(list);
    } hwloc_bitmap_foreach_end();
    printf("\n");
    return 0;
}

int main(int argc, char **argv)
{
    enum hwloc_type_filter_e filter = HWLOC_TYPE_FILTER_KEEP_ALL;
    const char *fname = "all";
    int set_filter = 1;
    int a = 1;
    if (a + 1 < argc && !strcmp(argv[a], "--filter")) {
        fname = argv[a + 1];
        if (!strcmp(fname, "all"))
            filter = HWLOC_TYPE_FILTER_KEEP_ALL;
        else if (!strcmp(fname, "important"))
            filter = HWLOC_TYPE_FILTER_KEEP_IMPORTANT;
        else if (!strcmp(fname, "none"))
            filter = HWLOC_TYPE_FILTER_KEEP_NONE;
        else if (!strcmp(fname, "default"))
            set_filter = 0;
        else {
            fprintf(stderr, "unknown filter %s\n", fname);
            return 2;
        }
        a += 2;
    }
    if (a >= argc) {
        fprintf(stderr, "usage: %s [--filter all|important|none|default] FILE.xml [BUSID...]\n", argv[0]);
        return 2;
    }

    hwloc_topology_t topo;
    hwloc_topology_init(&topo);
    /* I/O objects (bridges, PCI and OS devices) are dropped by default (KEEP_NONE). */
    if (set_filter)
        hwloc_topology_set_io_types_filter(topo, filter);
    if (hwloc_topology_set_xml(topo, argv[a]) < 0) {
        perror(argv[a]);
        return 2;
    }
    if (hwloc_topology_load(topo) < 0) {
        perror("hwloc_topology_load");
        return 2;
    }

    unsigned npci = 0, ngpu = 0;
    for (hwloc_obj_t d = NULL; (d = hwloc_get_next_pcidev(topo, d));) {
        npci++;
        ngpu += d->attr->pcidev.class_id == 0x0302;
    }
    printf("# %s filter=%s pcidevs=%u gpus=%u numanodes=%d\n", argv[a], fname, npci, ngpu,
           hwloc_bitmap_weight(hwloc_get_root_obj(topo)->nodeset));

    int rc = 0;
    if (a + 1 < argc) {
        for (int i = a + 1; i < argc; i++)
            rc |= report(topo, argv[i]);
    } else {
        if (ngpu == 0)
            rc = 1;
        for (hwloc_obj_t d = NULL; (d = hwloc_get_next_pcidev(topo, d));) {
            if (d->attr->pcidev.class_id != 0x0302)
                continue;
            char busid[32];
            snprintf(busid, sizeof busid, "%04x:%02x:%02x.%01x", d->attr->pcidev.domain,
                     d->attr->pcidev.bus, d->attr->pcidev.dev, d->attr->pcidev.func);
            rc |= report(topo, busid);
        }
    }
    hwloc_topology_destroy(topo);
    return rc;
}
