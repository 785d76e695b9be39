/*
 * gpumon NVML injection library.
 *
 * A stand-in for libnvidia-ml.so.1 that implements the NVML entry points gpumon uses and answers them
 * from a state file, so the real nvidia-ml-py (pynvml) can be tested on machines without GPUs. Built by
 * gpumon.sim.nvml_inject.build_library() with the soname libnvidia-ml.so.1; loaded either through
 * LD_LIBRARY_PATH or by preloading it RTLD_GLOBAL before pynvml's CDLL("libnvidia-ml.so.1").
 *
 * The declarations below are written from nvidia-ml-py's ctypes definitions (pynvml.py), which are the
 * ground truth for what pynvml passes; struct sizes are checked with _Static_assert.
 *
 * State file
 * ----------
 * Path: $GPUMON_NVML_INJECT_STATE, looked up on every call. The file is re-read whenever its
 * (path, device, inode, size, mtime, ctime) changes; writers replace it atomically (gpumon.sim.nvml_state
 * .write_state). Format (version 1): printable ASCII only, '\n' line ends, lines shorter than 1024
 * bytes, at most 4 MiB:
 *
 *   gpumon-nvml-inject-state 1              mandatory first line
 *   # comment / blank lines                 ignored
 *   KEY VALUE                               KEY = text up to the first space
 *   end                                     mandatory last record (guards against truncation)
 *
 * String keys take the rest of the line verbatim (spaces allowed); other keys take tokens separated by
 * single spaces: unsigned decimal integers, '-' (not available), PCI bus ids, 32-hex-digit UUIDs and
 * symbol names.
 *
 * Node keys (before the first "gpu" line):
 *   driver_version S | nvml_version S | cuda_driver_version N | init_error N (nvmlReturn_t of nvmlInit*)
 *   call SYMBOL|* ERROR HANG_US                 node-level injection for system functions
 * GPU keys ("gpu N" starts GPU N; N = 0, 1, 2, ... in order):
 *   name S | uuid S | serial S | pci BUSID DEVICEID SUBSYSID | minor_number N | architecture N |
 *   brand N | cuda_cc MAJOR MINOR | numa_node N | memory TOTAL USED RESERVED |
 *   nvlink LINK ACTIVE REPLAY RECOVERY CRC_FLIT CRC_DATA REMOTE_BUSID|-   (links 0.. in order) |
 *   clocks_event_reasons CURRENT SUPPORTED | violation POLICY NS | temperature GPU MEM|- |
 *   thresholds SHUTDOWN SLOWDOWN MEM_MAX GPU_MAX | clocks SM MEM VIDEO MAX_SM MAX_MEM MAX_VIDEO |
 *   power USAGE_MW LIMIT_MW | pcie GEN MAXGEN WIDTH MAXWIDTH | utilization GPU MEM |
 *   pcie_throughput TX_KBPS RX_KBPS |
 *   ecc_mode CUR PEND | ecc_errors VOL_CORR VOL_UNC AGG_CORR AGG_UNC |
 *   remapped_rows CORR UNC PENDING FAILURE | remap_histogram MAX HIGH PARTIAL LOW NONE |
 *   retired_pages SBE|- DBE|- PENDING | fabric STATE STATUS CLIQUE UUIDHEX HEALTHMASK HEALTHSUMMARY |
 *   supported_events MASK | p2p PEER STATUS | topology PEER LEVEL | xid CODE SEQ |
 *   process PID USED_BYTES|-   (one per compute process, pids unique per GPU) |
 *   call SYMBOL|* ERROR HANG_US
 *
 * Any unknown key, malformed number or out-of-range value rejects the whole file: nvmlInit* then
 * returns NVML_ERROR_DRIVER_NOT_LOADED, and other calls NVML_ERROR_UNKNOWN, with the reason written to
 * stderr once.
 *
 * Behaviour
 * ---------
 * - Injection: each device function first looks up its own symbol name (then "*") in the device's
 *   "call" lines, system functions in the node's; it sleeps HANG_US microseconds WITHOUT holding the
 *   state lock, then returns ERROR if it is not 0.
 * - Calls before nvmlInit*: NVML_ERROR_UNINITIALIZED. Init is reference counted like NVML.
 * - Handles stay valid across reloads; a handle whose GPU disappeared from the state: GPU_IS_LOST.
 * - Events: nvmlEventSetWait_v2 delivers every "xid" record of a registered device (event type
 *   nvmlEventTypeXidCriticalError, eventData = code) once per event set, lowest seq first; it polls the
 *   state until timeoutms and returns NVML_ERROR_TIMEOUT if nothing new arrived.
 * - NVLink: no links -> NOT_SUPPORTED for every NvLink call; link >= count -> INVALID_ARGUMENT.
 * - Fabric info: NOT_SUPPORTED before Hopper (architecture < 9).
 * - PCIe throughput: nvmlDeviceGetPcieThroughput answers the "pcie_throughput" line (KB/s, counter
 *   NVML_PCIE_UTIL_TX_BYTES 0 / RX_BYTES 1; another counter -> INVALID_ARGUMENT). Real NVML measures
 *   it over a 20 ms window; here it is whatever the state says.
 * - Compute processes: the "process" records in file order, MIG ids 0xFFFFFFFF (MIG off); sizing like
 *   NVML: *infoCount too small (0 to query) -> INSUFFICIENT_SIZE with the count, SUCCESS if there are none.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------------------------ NVML types */

typedef unsigned int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct nvmlEventSet_st *nvmlEventSet_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int version, domain, bus, device, pciDeviceId, pciSubSystemId, baseClass, subClass;
    char busId[32];
} nvmlPciInfoExt_v1_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned long long referenceTime, violationTime;
} nvmlViolationTime_t;

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType, eventData;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

typedef struct {
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId, state;
} nvmlGpuFabricInfo_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId, state, healthMask;
} nvmlGpuFabricInfo_v2_t;

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId, state, healthMask;
    unsigned char healthSummary;
} nvmlGpuFabricInfo_v3_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    unsigned int max, high, partial, low, none;
} nvmlRowRemapperHistogramValues_t;

typedef struct {
    unsigned int version, sensorType;
    int temperature;
} nvmlTemperature_v1_t;

/* nvml.h nvmlProcessInfo_v2_t; nvmlProcessInfo_t (what the _v3 entry points take) has the same fields, and
 * pynvml defines c_nvmlProcessInfo_v3_t = c_nvmlProcessInfo_v2_t. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory; /* NVML_VALUE_NOT_AVAILABLE (all ones) when unknown */
    unsigned int gpuInstanceId, computeInstanceId; /* 0xFFFFFFFF when MIG is off */
} nvmlProcessInfo_v2_t;

_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(nvmlPciInfoExt_v1_t) == 64, "nvmlPciInfoExt_v1_t layout");
_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t layout");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t layout");
_Static_assert(sizeof(nvmlViolationTime_t) == 16, "nvmlViolationTime_t layout");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t layout");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t layout");
_Static_assert(sizeof(nvmlGpuFabricInfo_t) == 28, "nvmlGpuFabricInfo_t layout");
_Static_assert(sizeof(nvmlGpuFabricInfo_v2_t) == 36, "nvmlGpuFabricInfo_v2_t layout");
_Static_assert(sizeof(nvmlGpuFabricInfo_v3_t) == 40, "nvmlGpuFabricInfo_v3_t layout");
_Static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t layout");
_Static_assert(sizeof(nvmlRowRemapperHistogramValues_t) == 20, "histogram layout");
_Static_assert(sizeof(nvmlTemperature_v1_t) == 12, "nvmlTemperature_v1_t layout");
_Static_assert(sizeof(nvmlProcessInfo_v2_t) == 24 && offsetof(nvmlProcessInfo_v2_t, usedGpuMemory) == 8 &&
                   offsetof(nvmlProcessInfo_v2_t, gpuInstanceId) == 16,
               "nvmlProcessInfo_v2_t layout");

/* Versioned structs: NVML_STRUCT_VERSION(name, v) = sizeof(struct) | (v << 24). */
#define STRUCT_VERSION(type, v) ((unsigned int)(sizeof(type) | ((v) << 24)))
#define NVML_PCI_INFO_EXT_V1 STRUCT_VERSION(nvmlPciInfoExt_v1_t, 1)
#define NVML_MEMORY_V2 STRUCT_VERSION(nvmlMemory_v2_t, 2)
#define NVML_FABRIC_INFO_V2 STRUCT_VERSION(nvmlGpuFabricInfo_v2_t, 2)
#define NVML_FABRIC_INFO_V3 STRUCT_VERSION(nvmlGpuFabricInfo_v3_t, 3)
#define NVML_TEMPERATURE_V1 STRUCT_VERSION(nvmlTemperature_v1_t, 1)

#define EVENT_TYPE_XID 0x8ULL /* nvmlEventTypeXidCriticalError */
#define VALUE_TYPE_UINT 1     /* NVML_VALUE_TYPE_UNSIGNED_INT */
#define VALUE_TYPE_ULL 3      /* NVML_VALUE_TYPE_UNSIGNED_LONG_LONG */
#define NVLINK_DEVICE_TYPE_GPU 0x00
#define NVLINK_DEVICE_TYPE_SWITCH 0x02
#define NVLINK_DEVICE_TYPE_UNKNOWN 0xFF
#define TOPOLOGY_INTERNAL 0
#define TOPOLOGY_NODE 40
#define TOPOLOGY_SYSTEM 50
#define P2P_CAPS_INDEX_NVLINK 2
#define P2P_CAPS_INDEX_UNKNOWN 5
#define P2P_STATUS_NOT_SUPPORTED 5
#define ARCH_AMPERE 7
#define ARCH_HOPPER 9

/* ------------------------------------------------------------------------------------ state model */

#define STATE_ENV "GPUMON_NVML_INJECT_STATE"
#define MAGIC_LINE "gpumon-nvml-inject-state 1"
#define MAX_GPUS 64
#define MAX_LINKS 36
#define MAX_CALLS 32
#define MAX_XIDS 256
#define MAX_MAP 32
#define MAX_PROCS 64
#define VALUE_NOT_AVAILABLE_ULL UINT64_MAX /* NVML_VALUE_NOT_AVAILABLE as unsigned long long */
#define MIG_ID_NONE 0xFFFFFFFFu
#define MAX_LINE 1024
#define MAX_FILE (4u << 20)
#define FN_LEN 64

typedef unsigned long long u64;

typedef struct {
    char fn[FN_LEN];
    unsigned int error;
    u64 hang_us;
} call_t;

typedef struct {
    unsigned int n;
    call_t v[MAX_CALLS];
} calls_t;

typedef struct {
    unsigned int n;
    struct {
        unsigned int key;
        u64 val;
    } v[MAX_MAP];
} kvmap_t;

typedef struct {
    unsigned int domain, bus, dev, func;
} busid_t;

typedef struct {
    char name[96], uuid[96], serial[30];
    busid_t pci;
    unsigned int pci_device_id, pci_subsystem_id, minor, arch, brand, numa;
    unsigned int cc_major, cc_minor;
    u64 mem_total, mem_used, mem_reserved;
    unsigned int nlinks;
    struct {
        unsigned int active;
        u64 err[4]; /* replay, recovery, crc_flit, crc_data = NVML_NVLINK_ERROR_DL_* 0..3 */
        int has_remote;
        busid_t remote;
    } link[MAX_LINKS];
    u64 cer_current, cer_supported;
    kvmap_t violation, p2p, topo;
    unsigned int temp_gpu;
    long long temp_mem; /* -1: not available */
    unsigned int thr[4]; /* shutdown, slowdown, mem max, gpu max = NVML_TEMPERATURE_THRESHOLD_* 0..3 */
    unsigned int clk[3], maxclk[3]; /* sm, mem, video */
    unsigned int power_mw, limit_mw;
    unsigned int pcie_gen, pcie_max_gen, pcie_width, pcie_max_width;
    unsigned int util_gpu, util_mem;
    unsigned int pcie_tx_kbps, pcie_rx_kbps;
    unsigned int ecc_cur, ecc_pend;
    u64 ecc[4]; /* volatile corrected, volatile uncorrected, aggregate corrected, aggregate uncorrected */
    unsigned int remap[4]; /* corrected, uncorrected, pending, failure */
    unsigned int hist[5];
    long long retired[2]; /* sbe, dbe; -1: not supported */
    unsigned int retired_pending;
    unsigned int fabric_state, fabric_status, fabric_clique, fabric_health, fabric_summary;
    unsigned char fabric_uuid[16];
    u64 supported_events;
    unsigned int nxids;
    struct {
        u64 code, seq;
    } xid[MAX_XIDS];
    unsigned int nprocs;
    struct {
        unsigned int pid;
        u64 used; /* VALUE_NOT_AVAILABLE_ULL: '-' in the state file */
    } proc[MAX_PROCS];
    calls_t calls;
} gpu_t;

typedef struct {
    char driver_version[80], nvml_version[80];
    unsigned int cuda_version, init_error;
    calls_t calls;
    unsigned int ngpus;
    gpu_t gpu[MAX_GPUS];
} state_t;

/* Device handles point into this array; they never move, so they survive state reloads. */
struct nvmlDevice_st {
    unsigned int index;
};
static struct nvmlDevice_st g_devices[MAX_GPUS];

#define EVENT_SET_MAGIC 0x6e766d45u
struct nvmlEventSet_st {
    unsigned int magic;
    u64 mask[MAX_GPUS];
    size_t ndelivered, cap;
    struct {
        unsigned int gpu;
        u64 seq;
    } *delivered;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static state_t *g_state;         /* parsed state of the current file; NULL if unusable */
static char g_state_err[512];    /* why g_state is NULL */
static char g_reported[512];     /* last message written to stderr */
static unsigned int g_init_count;
static struct {
    int valid;
    char path[PATH_MAX];
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime, ctime;
} g_id;

/* ------------------------------------------------------------------------------------ parsing */

typedef struct {
    char *p;       /* cursor in the current line */
    int lineno;
    char *err;     /* error buffer (512 bytes) */
} cursor_t;

static int fail(cursor_t *c, const char *what) {
    snprintf(c->err, 512, "line %d: %s", c->lineno, what);
    return -1;
}

/* Next space-separated token (single spaces); returns NULL at end of line. */
static char *next_token(cursor_t *c) {
    if (*c->p == '\0') return NULL;
    if (*c->p == ' ') return NULL; /* double space or leading space */
    char *start = c->p;
    char *sp = strchr(c->p, ' ');
    if (sp) {
        *sp = '\0';
        c->p = sp + 1;
        if (*c->p == '\0') return NULL; /* trailing space */
    } else {
        c->p += strlen(c->p);
    }
    return start;
}

static int parse_u64_str(const char *t, u64 max, u64 *out) {
    if (!t || !*t || strlen(t) > 20) return -1;
    u64 v = 0;
    for (const char *q = t; *q; q++) {
        if (*q < '0' || *q > '9') return -1;
        unsigned int d = (unsigned int)(*q - '0');
        if (v > (UINT64_MAX - d) / 10) return -1;
        v = v * 10 + d;
    }
    if (v > max) return -1;
    *out = v;
    return 0;
}

static int tok_u64(cursor_t *c, u64 max, u64 *out) {
    if (parse_u64_str(next_token(c), max, out) != 0) return fail(c, "expected an unsigned integer in range");
    return 0;
}

static int tok_u32(cursor_t *c, unsigned int max, unsigned int *out) {
    u64 v;
    if (tok_u64(c, max, &v) != 0) return -1;
    *out = (unsigned int)v;
    return 0;
}

static int tok_opt(cursor_t *c, long long *out) { /* '-' or u32 */
    char *t = next_token(c);
    u64 v;
    if (t && strcmp(t, "-") == 0) {
        *out = -1;
        return 0;
    }
    if (parse_u64_str(t, UINT32_MAX, &v) != 0) return fail(c, "expected an unsigned integer or '-'");
    *out = (long long)v;
    return 0;
}

static int end_of_line(cursor_t *c) {
    if (*c->p != '\0') return fail(c, "unexpected extra text at end of line");
    return 0;
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

/* Hex number of 1..maxdigits digits ending at one of the characters in 'stops' (or end of string). */
static const char *parse_hex(const char *s, int maxdigits, unsigned int *out, const char *stops) {
    unsigned int v = 0;
    int n = 0;
    while (*s && !strchr(stops, *s)) {
        int h = hexval(*s);
        if (h < 0 || ++n > maxdigits) return NULL;
        v = (v << 4) | (unsigned int)h;
        s++;
    }
    if (n == 0) return NULL;
    *out = v;
    return s;
}

/* Accepts DOMAIN:BUS:DEV.FN, DOMAIN:BUS:DEV, BUS:DEV.FN and BUS:DEV (hex, domain up to 8 digits). */
static int parse_bus_id(const char *s, busid_t *out) {
    unsigned int a, b, d, f = 0;
    const char *p = parse_hex(s, 8, &a, ":");
    if (!p || *p != ':') return -1;
    p = parse_hex(p + 1, 2, &b, ":.");
    if (!p) return -1;
    if (*p == ':') { /* DOMAIN:BUS:DEV */
        out->domain = a;
        out->bus = b;
        p = parse_hex(p + 1, 2, &d, ".");
        if (!p) return -1;
    } else { /* BUS:DEV */
        if (a > 0xFF) return -1;
        out->domain = 0;
        out->bus = a;
        d = b;
    }
    if (*p == '.') {
        p = parse_hex(p + 1, 1, &f, "");
        if (!p || f > 7) return -1;
    }
    if (*p != '\0' || d > 0x1F) return -1;
    out->dev = d;
    out->func = f;
    return 0;
}

static int busid_eq(const busid_t *x, const busid_t *y) {
    return x->domain == y->domain && x->bus == y->bus && x->dev == y->dev && x->func == y->func;
}

static int tok_busid(cursor_t *c, busid_t *out, int *present) {
    char *t = next_token(c);
    if (present && t && strcmp(t, "-") == 0) {
        *present = 0;
        return 0;
    }
    if (!t || parse_bus_id(t, out) != 0) return fail(c, "bad PCI bus id");
    if (present) *present = 1;
    return 0;
}

static int set_string(cursor_t *c, char *dst, size_t cap) {
    size_t n = strlen(c->p);
    if (n >= cap) return fail(c, "string value too long");
    memcpy(dst, c->p, n + 1);
    c->p += n;
    return 0;
}

static int parse_call(cursor_t *c, calls_t *calls) {
    char *fn = next_token(c);
    if (!fn) return fail(c, "call: missing symbol");
    size_t n = strlen(fn);
    if (n == 0 || n >= FN_LEN) return fail(c, "call: bad symbol length");
    for (size_t i = 0; i < n; i++) {
        char ch = fn[i];
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                 ch == '_' || (ch == '*' && n == 1);
        if (!ok) return fail(c, "call: bad symbol");
    }
    if (calls->n >= MAX_CALLS) return fail(c, "call: too many call lines");
    call_t *call = &calls->v[calls->n];
    memcpy(call->fn, fn, n + 1);
    if (tok_u32(c, UINT32_MAX, &call->error) || tok_u64(c, UINT64_MAX, &call->hang_us)) return -1;
    calls->n++;
    return 0;
}

static int parse_kv(cursor_t *c, kvmap_t *m, unsigned int maxkey, u64 maxval) {
    if (m->n >= MAX_MAP) return fail(c, "too many entries");
    unsigned int key;
    u64 val;
    if (tok_u32(c, maxkey, &key) || tok_u64(c, maxval, &val)) return -1;
    for (unsigned int i = 0; i < m->n; i++)
        if (m->v[i].key == key) return fail(c, "duplicate key");
    m->v[m->n].key = key;
    m->v[m->n].val = val;
    m->n++;
    return 0;
}

/* Table of all-numeric GPU lines: 'u' u32, 'U' u64, 'b' 0/1 (u32), 'o' u32 or '-' (long long, -1). */
#define GOFF(member) offsetof(gpu_t, member)
static const struct {
    const char *key;
    const char *fmt;
    size_t off[6];
} k_numeric_lines[] = {
    {"minor_number", "u", {GOFF(minor)}},
    {"architecture", "u", {GOFF(arch)}},
    {"brand", "u", {GOFF(brand)}},
    {"numa_node", "u", {GOFF(numa)}},
    {"cuda_cc", "uu", {GOFF(cc_major), GOFF(cc_minor)}},
    {"memory", "UUU", {GOFF(mem_total), GOFF(mem_used), GOFF(mem_reserved)}},
    {"clocks_event_reasons", "UU", {GOFF(cer_current), GOFF(cer_supported)}},
    {"temperature", "uo", {GOFF(temp_gpu), GOFF(temp_mem)}},
    {"thresholds", "uuuu", {GOFF(thr[0]), GOFF(thr[1]), GOFF(thr[2]), GOFF(thr[3])}},
    {"clocks", "uuuuuu",
     {GOFF(clk[0]), GOFF(clk[1]), GOFF(clk[2]), GOFF(maxclk[0]), GOFF(maxclk[1]), GOFF(maxclk[2])}},
    {"power", "uu", {GOFF(power_mw), GOFF(limit_mw)}},
    {"pcie", "uuuu", {GOFF(pcie_gen), GOFF(pcie_max_gen), GOFF(pcie_width), GOFF(pcie_max_width)}},
    {"utilization", "uu", {GOFF(util_gpu), GOFF(util_mem)}},
    {"pcie_throughput", "uu", {GOFF(pcie_tx_kbps), GOFF(pcie_rx_kbps)}},
    {"ecc_mode", "bb", {GOFF(ecc_cur), GOFF(ecc_pend)}},
    {"ecc_errors", "UUUU", {GOFF(ecc[0]), GOFF(ecc[1]), GOFF(ecc[2]), GOFF(ecc[3])}},
    {"remapped_rows", "uubb", {GOFF(remap[0]), GOFF(remap[1]), GOFF(remap[2]), GOFF(remap[3])}},
    {"remap_histogram", "uuuuu", {GOFF(hist[0]), GOFF(hist[1]), GOFF(hist[2]), GOFF(hist[3]), GOFF(hist[4])}},
    {"retired_pages", "oob", {GOFF(retired[0]), GOFF(retired[1]), GOFF(retired_pending)}},
    {"supported_events", "U", {GOFF(supported_events)}},
};

static int parse_numeric_line(cursor_t *c, gpu_t *g, const char *fmt, const size_t *off) {
    for (size_t i = 0; fmt[i]; i++) {
        char *dst = (char *)g + off[i];
        unsigned int u;
        u64 U;
        long long o;
        switch (fmt[i]) {
        case 'u':
        case 'b':
            if (tok_u32(c, fmt[i] == 'b' ? 1 : UINT32_MAX, &u)) return -1;
            memcpy(dst, &u, sizeof u);
            break;
        case 'U':
            if (tok_u64(c, UINT64_MAX, &U)) return -1;
            memcpy(dst, &U, sizeof U);
            break;
        default: /* 'o' */
            if (tok_opt(c, &o)) return -1;
            memcpy(dst, &o, sizeof o);
            break;
        }
    }
    return end_of_line(c);
}

static int parse_gpu_line(cursor_t *c, gpu_t *g, const char *key) {
    for (size_t i = 0; i < sizeof k_numeric_lines / sizeof k_numeric_lines[0]; i++)
        if (strcmp(key, k_numeric_lines[i].key) == 0)
            return parse_numeric_line(c, g, k_numeric_lines[i].fmt, k_numeric_lines[i].off);

    if (strcmp(key, "name") == 0) return set_string(c, g->name, sizeof g->name);
    if (strcmp(key, "uuid") == 0) return set_string(c, g->uuid, sizeof g->uuid);
    if (strcmp(key, "serial") == 0) return set_string(c, g->serial, sizeof g->serial);
    if (strcmp(key, "pci") == 0) {
        if (tok_busid(c, &g->pci, NULL) || tok_u32(c, UINT32_MAX, &g->pci_device_id) ||
            tok_u32(c, UINT32_MAX, &g->pci_subsystem_id))
            return -1;
        return end_of_line(c);
    }
    if (strcmp(key, "nvlink") == 0) {
        unsigned int link;
        if (tok_u32(c, MAX_LINKS - 1, &link)) return -1;
        if (link != g->nlinks) return fail(c, "nvlink lines must list links 0, 1, 2, ... in order");
        if (tok_u32(c, 1, &g->link[link].active)) return -1;
        for (int k = 0; k < 4; k++)
            if (tok_u64(c, UINT64_MAX, &g->link[link].err[k])) return -1;
        if (tok_busid(c, &g->link[link].remote, &g->link[link].has_remote)) return -1;
        g->nlinks++;
        return end_of_line(c);
    }
    if (strcmp(key, "violation") == 0) {
        if (parse_kv(c, &g->violation, 11, UINT64_MAX)) return -1;
        return end_of_line(c);
    }
    if (strcmp(key, "p2p") == 0 || strcmp(key, "topology") == 0) {
        if (parse_kv(c, key[0] == 'p' ? &g->p2p : &g->topo, MAX_GPUS - 1, UINT32_MAX)) return -1;
        return end_of_line(c);
    }
    if (strcmp(key, "fabric") == 0) {
        if (tok_u32(c, UINT32_MAX, &g->fabric_state) || tok_u32(c, UINT32_MAX, &g->fabric_status) ||
            tok_u32(c, UINT32_MAX, &g->fabric_clique))
            return -1;
        char *hex = next_token(c);
        if (!hex || strlen(hex) != 32) return fail(c, "fabric: cluster uuid must be 32 hex digits");
        for (int k = 0; k < 16; k++) {
            int hi = hexval(hex[2 * k]), lo = hexval(hex[2 * k + 1]);
            if (hi < 0 || lo < 0) return fail(c, "fabric: cluster uuid must be 32 hex digits");
            g->fabric_uuid[k] = (unsigned char)(hi << 4 | lo);
        }
        if (tok_u32(c, UINT32_MAX, &g->fabric_health) || tok_u32(c, 0xFF, &g->fabric_summary)) return -1;
        return end_of_line(c);
    }
    if (strcmp(key, "xid") == 0) {
        if (g->nxids >= MAX_XIDS) return fail(c, "too many xid lines");
        if (tok_u64(c, UINT64_MAX, &g->xid[g->nxids].code) || tok_u64(c, UINT64_MAX, &g->xid[g->nxids].seq))
            return -1;
        g->nxids++;
        return end_of_line(c);
    }
    if (strcmp(key, "process") == 0) {
        if (g->nprocs >= MAX_PROCS) return fail(c, "too many process lines");
        unsigned int pid;
        if (tok_u32(c, UINT32_MAX, &pid)) return -1;
        for (unsigned int i = 0; i < g->nprocs; i++)
            if (g->proc[i].pid == pid) return fail(c, "process: duplicate pid");
        char *t = next_token(c);
        u64 used;
        if (t && strcmp(t, "-") == 0)
            used = VALUE_NOT_AVAILABLE_ULL;
        else if (parse_u64_str(t, VALUE_NOT_AVAILABLE_ULL - 1, &used) != 0)
            return fail(c, "process: used memory must be bytes below 2^64-1 or '-'");
        g->proc[g->nprocs].pid = pid;
        g->proc[g->nprocs].used = used;
        g->nprocs++;
        return end_of_line(c);
    }
    if (strcmp(key, "call") == 0) {
        if (parse_call(c, &g->calls)) return -1;
        return end_of_line(c);
    }
    return fail(c, "unknown key in gpu section");
}

static int parse_node_line(cursor_t *c, state_t *s, const char *key) {
    if (strcmp(key, "driver_version") == 0) return set_string(c, s->driver_version, sizeof s->driver_version);
    if (strcmp(key, "nvml_version") == 0) return set_string(c, s->nvml_version, sizeof s->nvml_version);
    if (strcmp(key, "cuda_driver_version") == 0) {
        if (tok_u32(c, INT32_MAX, &s->cuda_version)) return -1;
        return end_of_line(c);
    }
    if (strcmp(key, "init_error") == 0) {
        if (tok_u32(c, UINT32_MAX, &s->init_error)) return -1;
        return end_of_line(c);
    }
    if (strcmp(key, "call") == 0) {
        if (parse_call(c, &s->calls)) return -1;
        return end_of_line(c);
    }
    return fail(c, "unknown key in node section");
}

static void gpu_defaults(gpu_t *g) {
    memset(g, 0, sizeof *g);
    g->temp_mem = -1;
    g->retired[0] = g->retired[1] = -1;
}

/* Parses 'text' (NUL-terminated, modified in place). Returns 0 and fills 's', or -1 with 'err' set. */
static int parse_state(char *text, state_t *s, char *err) {
    cursor_t c = {.p = NULL, .lineno = 0, .err = err};
    int in_gpu = 0, ended = 0;
    char *line = text;
    while (*line) {
        char *nl = strchr(line, '\n');
        c.lineno++;
        if (!nl) return fail(&c, "last line is not terminated (truncated file?)");
        *nl = '\0';
        if (nl - line >= MAX_LINE) return fail(&c, "line too long");
        for (char *q = line; *q; q++) /* printable ASCII only, like the strings real NVML returns */
            if ((unsigned char)*q < 0x20 || (unsigned char)*q > 0x7E)
                return fail(&c, "control character or non-ASCII byte in line");
        char *next = nl + 1;
        c.p = line;
        if (c.lineno == 1) {
            if (strcmp(line, MAGIC_LINE) != 0) return fail(&c, "not a gpumon NVML injection state file (bad magic line)");
        } else if (line[0] == '\0' || line[0] == '#') {
            /* blank or comment */
        } else if (ended) {
            return fail(&c, "text after 'end'");
        } else {
            char *sp = strchr(line, ' ');
            const char *key = line;
            if (sp) {
                *sp = '\0';
                c.p = sp + 1;
            } else {
                c.p = line + strlen(line);
            }
            if (strcmp(key, "end") == 0) {
                if (end_of_line(&c)) return -1;
                ended = 1;
            } else if (strcmp(key, "gpu") == 0) {
                unsigned int idx;
                if (tok_u32(&c, MAX_GPUS - 1, &idx) || end_of_line(&c)) return -1;
                if (idx != s->ngpus) return fail(&c, "gpu sections must be numbered 0, 1, 2, ... in order");
                gpu_defaults(&s->gpu[idx]);
                s->ngpus++;
                in_gpu = 1;
            } else if (in_gpu) {
                if (parse_gpu_line(&c, &s->gpu[s->ngpus - 1], key)) return -1;
            } else {
                if (parse_node_line(&c, s, key)) return -1;
            }
        }
        line = next;
    }
    if (c.lineno == 0) {
        snprintf(err, 512, "empty file");
        return -1;
    }
    if (!ended) return fail(&c, "missing 'end' line (truncated file?)");
    return 0;
}

/* ------------------------------------------------------------------------------------ loading */

static void report(const char *msg) { /* stderr, once per distinct message */
    if (strcmp(msg, g_reported) == 0) return;
    snprintf(g_reported, sizeof g_reported, "%s", msg);
    fprintf(stderr, "gpumon-nvml-inject: %s\n", msg);
    fflush(stderr);
}

static int same_identity(const char *path, const struct stat *st) {
    return g_id.valid && strcmp(g_id.path, path) == 0 && g_id.dev == st->st_dev && g_id.ino == st->st_ino &&
           g_id.size == st->st_size && g_id.mtime.tv_sec == st->st_mtim.tv_sec &&
           g_id.mtime.tv_nsec == st->st_mtim.tv_nsec && g_id.ctime.tv_sec == st->st_ctim.tv_sec &&
           g_id.ctime.tv_nsec == st->st_ctim.tv_nsec;
}

static void set_unusable(const char *fmt, const char *a, const char *b) {
    free(g_state);
    g_state = NULL;
    snprintf(g_state_err, sizeof g_state_err, fmt, a, b);
}

/* Makes g_state match the file named by $GPUMON_NVML_INJECT_STATE. Caller holds g_mu. 0 = usable. */
static int refresh_locked(void) {
    const char *path = getenv(STATE_ENV);
    struct stat st;
    if (!path || !*path) {
        g_id.valid = 0;
        set_unusable("%s%s is not set; behaving as if no NVIDIA driver is loaded", STATE_ENV, "");
        return -1;
    }
    if (strlen(path) >= sizeof g_id.path) {
        g_id.valid = 0;
        set_unusable("%s: state file path too long%s", STATE_ENV, "");
        return -1;
    }
    if (stat(path, &st) == 0 && same_identity(path, &st)) return g_state ? 0 : -1;

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) != 0) {
        if (fd >= 0) close(fd);
        g_id.valid = 0;
        set_unusable("cannot read state file %s: %s", path, strerror(errno));
        return -1;
    }
    g_id.valid = 1;
    snprintf(g_id.path, sizeof g_id.path, "%s", path);
    g_id.dev = st.st_dev;
    g_id.ino = st.st_ino;
    g_id.size = st.st_size;
    g_id.mtime = st.st_mtim;
    g_id.ctime = st.st_ctim;
    if (!S_ISREG(st.st_mode) || st.st_size < 0 || (unsigned long long)st.st_size > MAX_FILE) {
        close(fd);
        set_unusable("state file %s is not a regular file of at most 4 MiB%s", path, "");
        return -1;
    }
    size_t size = (size_t)st.st_size;
    char *text = malloc(size + 1);
    state_t *s = calloc(1, sizeof *s);
    size_t got = 0;
    while (text && got < size) {
        ssize_t r = read(fd, text + got, size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    if (!text || !s) {
        free(text);
        free(s);
        set_unusable("out of memory reading %s%s", path, "");
        return -1;
    }
    text[got] = '\0';
    char perr[512] = "";
    int rc;
    if (got != size) {
        snprintf(perr, sizeof perr, "short read");
        rc = -1;
    } else if (memchr(text, '\0', got)) {
        snprintf(perr, sizeof perr, "file contains NUL bytes");
        rc = -1;
    } else {
        rc = parse_state(text, s, perr);
    }
    free(text);
    if (rc != 0) {
        free(s);
        set_unusable("rejected state file %s: %s", path, perr);
        return -1;
    }
    free(g_state);
    g_state = s;
    g_state_err[0] = '\0';
    return 0;
}

/* ------------------------------------------------------------------------------------ call framework */

static u64 now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (u64)ts.tv_sec * 1000000ULL + (u64)ts.tv_nsec / 1000ULL;
}

static void sleep_us(u64 us) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += (time_t)(us / 1000000ULL);
    ts.tv_nsec += (long)(us % 1000000ULL) * 1000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static const call_t *find_call(const calls_t *calls, const char *fn) {
    const call_t *wild = NULL;
    for (unsigned int i = 0; i < calls->n; i++) {
        if (strcmp(calls->v[i].fn, fn) == 0) return &calls->v[i];
        if (!wild && strcmp(calls->v[i].fn, "*") == 0) wild = &calls->v[i];
    }
    return wild;
}

static nvmlReturn_t leave(nvmlReturn_t rc) {
    pthread_mutex_unlock(&g_mu);
    return rc;
}

/* Lock, check init and state. On success returns NVML_SUCCESS with g_mu held. */
static nvmlReturn_t lock_initialized(void) {
    pthread_mutex_lock(&g_mu);
    if (g_init_count == 0) return leave(NVML_ERROR_UNINITIALIZED);
    if (refresh_locked() != 0) {
        report(g_state_err);
        return leave(NVML_ERROR_UNKNOWN);
    }
    return NVML_SUCCESS;
}

/* Applies an injection (hang, then error). Called with g_mu held; on success g_mu is held again and the
 * state is usable (it may have been reloaded during the hang). */
static nvmlReturn_t apply_injection(const call_t *call) {
    if (!call) return NVML_SUCCESS;
    u64 hang = call->hang_us;
    nvmlReturn_t err = call->error;
    if (hang) {
        pthread_mutex_unlock(&g_mu);
        sleep_us(hang);
        pthread_mutex_lock(&g_mu);
        if (g_init_count == 0) return leave(NVML_ERROR_UNINITIALIZED);
        if (refresh_locked() != 0) {
            report(g_state_err);
            return leave(NVML_ERROR_UNKNOWN);
        }
    }
    if (err) return leave(err);
    return NVML_SUCCESS;
}

/* Entry for system functions: init check, node-level injection. g_mu held on success. */
static nvmlReturn_t enter_system(const char *fn) {
    nvmlReturn_t rc = lock_initialized();
    if (rc) return rc;
    return apply_injection(find_call(&g_state->calls, fn));
}

static int handle_index(nvmlDevice_t h, unsigned int *idx) {
    uintptr_t base = (uintptr_t)g_devices, p = (uintptr_t)h;
    if (p < base || p >= base + sizeof g_devices || (p - base) % sizeof g_devices[0]) return -1;
    *idx = (unsigned int)((p - base) / sizeof g_devices[0]);
    return 0;
}

/* Device-function entry after the index is known; g_mu held on entry and on success. */
static nvmlReturn_t enter_index_locked(const char *fn, unsigned int idx, gpu_t **g) {
    if (idx >= g_state->ngpus) return leave(NVML_ERROR_GPU_IS_LOST);
    nvmlReturn_t rc = apply_injection(find_call(&g_state->gpu[idx].calls, fn));
    if (rc) return rc;
    if (idx >= g_state->ngpus) return leave(NVML_ERROR_GPU_IS_LOST); /* state changed during a hang */
    *g = &g_state->gpu[idx];
    return NVML_SUCCESS;
}

/* Entry for device functions: init check, handle check, the device's injection. g_mu held on success. */
static nvmlReturn_t enter_device(const char *fn, nvmlDevice_t h, gpu_t **g) {
    unsigned int idx;
    nvmlReturn_t rc = lock_initialized();
    if (rc) return rc;
    if (handle_index(h, &idx) != 0) return leave(NVML_ERROR_INVALID_ARGUMENT);
    return enter_index_locked(fn, idx, g);
}

#define DEVICE_ENTER(h, g)                                                                                   \
    gpu_t *g;                                                                                                \
    do {                                                                                                     \
        nvmlReturn_t rc_ = enter_device(__func__, (h), &g);                                                  \
        if (rc_) return rc_;                                                                                 \
    } while (0)

#define REQUIRE(cond)                                                                                        \
    do {                                                                                                     \
        if (!(cond)) return leave(NVML_ERROR_INVALID_ARGUMENT);                                              \
    } while (0)

static nvmlReturn_t copy_string(char *dst, unsigned int len, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    size_t n = strlen(src);
    if ((size_t)len < n + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, n + 1);
    return NVML_SUCCESS;
}

static unsigned int gpu_index(const gpu_t *g) { return (unsigned int)(g - g_state->gpu); }

static const u64 *kv_get(const kvmap_t *m, unsigned int key) {
    for (unsigned int i = 0; i < m->n; i++)
        if (m->v[i].key == key) return &m->v[i].val;
    return NULL;
}

static void format_bus_ids(const busid_t *b, char *legacy, size_t legacy_len, char *full, size_t full_len) {
    if (legacy && snprintf(legacy, legacy_len, "%04X:%02X:%02X.%X", b->domain & 0xFFFFu, b->bus & 0xFFu,
                           b->dev & 0x1Fu, b->func & 0x7u) >= (int)legacy_len)
        legacy[legacy_len - 1] = '\0';
    if (full && snprintf(full, full_len, "%08X:%02X:%02X.%X", b->domain, b->bus & 0xFFu, b->dev & 0x1Fu,
                         b->func & 0x7u) >= (int)full_len)
        full[full_len - 1] = '\0';
}

static void fill_pci_info(nvmlPciInfo_t *pci, const busid_t *b, unsigned int device_id, unsigned int subsys) {
    memset(pci, 0, sizeof *pci);
    format_bus_ids(b, pci->busIdLegacy, sizeof pci->busIdLegacy, pci->busId, sizeof pci->busId);
    pci->domain = b->domain;
    pci->bus = b->bus;
    pci->device = b->dev;
    pci->pciDeviceId = device_id;
    pci->pciSubSystemId = subsys;
}

static const gpu_t *gpu_by_bus(const busid_t *b) {
    for (unsigned int i = 0; i < g_state->ngpus; i++)
        if (busid_eq(&g_state->gpu[i].pci, b)) return &g_state->gpu[i];
    return NULL;
}

/* ------------------------------------------------------------------------------------ init, system */

static nvmlReturn_t init_impl(const char *fn) {
    pthread_mutex_lock(&g_mu);
    if (refresh_locked() != 0) {
        report(g_state_err);
        return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    }
    const call_t *call = find_call(&g_state->calls, fn);
    if (call && call->hang_us) {
        pthread_mutex_unlock(&g_mu);
        sleep_us(call->hang_us);
        pthread_mutex_lock(&g_mu);
        if (refresh_locked() != 0) {
            report(g_state_err);
            return leave(NVML_ERROR_DRIVER_NOT_LOADED);
        }
    }
    if (call && call->error) return leave(call->error);
    if (g_state->init_error) return leave(g_state->init_error);
    for (unsigned int i = 0; i < MAX_GPUS; i++) g_devices[i].index = i;
    g_init_count++;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return init_impl(__func__);
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return init_impl(__func__); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_mu);
    if (g_init_count == 0) return leave(NVML_ERROR_UNINITIALIZED);
    if (refresh_locked() == 0) { /* a broken state file must not stop a clean shutdown */
        nvmlReturn_t rc = apply_injection(find_call(&g_state->calls, __func__));
        if (rc) return rc;
        if (g_init_count == 0) return leave(NVML_ERROR_UNINITIALIZED);
    }
    g_init_count--;
    return leave(NVML_SUCCESS);
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    static const struct {
        nvmlReturn_t code;
        const char *text;
    } strings[] = {
        {0, "Success"},
        {1, "Uninitialized"},
        {2, "Invalid Argument"},
        {3, "Not Supported"},
        {4, "Insufficient Permissions"},
        {5, "Already Initialized"},
        {6, "Not Found"},
        {7, "Insufficient Size"},
        {8, "Insufficient External Power"},
        {9, "Driver Not Loaded"},
        {10, "Timeout"},
        {11, "Interrupt Request Issue"},
        {12, "NVML Shared Library Not Found"},
        {13, "Function Not Found"},
        {14, "Corrupted infoROM"},
        {15, "GPU is lost"},
        {16, "GPU requires restart"},
        {17, "The operating system has blocked the request."},
        {18, "RM has detected an NVML/RM version mismatch."},
        {19, "In use by another client"},
        {20, "Insufficient Memory"},
        {21, "No data"},
        {22, "The requested vgpu operation is not available on target device, because ECC is enabled"},
        {23, "Insufficient resources"},
        {24, "Frequency not supported"},
        {25, "Argument version mismatch"},
        {26, "Deprecated"},
        {27, "Not ready"},
        {28, "GPU not found"},
        {29, "Invalid state"},
        {30, "Reset type not supported"},
        {999, "Unknown Error"},
    };
    for (size_t i = 0; i < sizeof strings / sizeof strings[0]; i++)
        if (strings[i].code == result) return strings[i].text;
    return "Unknown Error";
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = enter_system(__func__);
    if (rc) return rc;
    return leave(copy_string(version, length, g_state->driver_version));
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = enter_system(__func__);
    if (rc) return rc;
    return leave(copy_string(version, length, g_state->nvml_version));
}

static nvmlReturn_t cuda_version_impl(const char *fn, int *version) {
    nvmlReturn_t rc = enter_system(fn);
    if (rc) return rc;
    REQUIRE(version);
    *version = (int)g_state->cuda_version;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { return cuda_version_impl(__func__, v); }
EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return cuda_version_impl(__func__, v); }

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    nvmlReturn_t rc = enter_system(__func__);
    if (rc) return rc;
    REQUIRE(count);
    *count = g_state->ngpus;
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ handles */

/* Node-level injection, then 'find' picks the GPU, then that GPU's injection. */
static nvmlReturn_t lookup_handle(const char *fn, nvmlDevice_t *device, int (*find)(const void *), const void *arg,
                                  nvmlReturn_t not_found) {
    nvmlReturn_t rc = enter_system(fn);
    if (rc) return rc;
    REQUIRE(device);
    int idx = find(arg);
    if (idx == -2) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (idx < 0) return leave(not_found);
    gpu_t *g;
    rc = enter_index_locked(fn, (unsigned int)idx, &g);
    if (rc) return rc;
    *device = &g_devices[gpu_index(g)];
    return leave(NVML_SUCCESS);
}

static int find_by_index(const void *arg) {
    unsigned int i = *(const unsigned int *)arg;
    return i < g_state->ngpus ? (int)i : -1;
}

static int find_by_uuid(const void *arg) {
    const char *uuid = arg;
    if (!uuid) return -2;
    for (unsigned int i = 0; i < g_state->ngpus; i++)
        if (strcmp(g_state->gpu[i].uuid, uuid) == 0) return (int)i;
    return -1;
}

static int find_by_bus(const void *arg) {
    busid_t b;
    if (!arg || parse_bus_id(arg, &b) != 0) return -2;
    const gpu_t *g = gpu_by_bus(&b);
    return g ? (int)gpu_index(g) : -1;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    /* NVML answers INVALID_ARGUMENT for an index >= count. */
    return lookup_handle(__func__, device, find_by_index, &index, NVML_ERROR_INVALID_ARGUMENT);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    return lookup_handle(__func__, device, find_by_uuid, uuid, NVML_ERROR_NOT_FOUND);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    return lookup_handle(__func__, device, find_by_bus, pciBusId, NVML_ERROR_NOT_FOUND);
}

/* ------------------------------------------------------------------------------------ identity */

EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    DEVICE_ENTER(device, g);
    REQUIRE(index);
    *index = gpu_index(g);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    DEVICE_ENTER(device, g);
    REQUIRE(minor);
    *minor = g->minor;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEVICE_ENTER(device, g);
    return leave(copy_string(name, length, g->name));
}

EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEVICE_ENTER(device, g);
    return leave(copy_string(uuid, length, g->uuid));
}

EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length) {
    DEVICE_ENTER(device, g);
    return leave(copy_string(serial, length, g->serial));
}

EXPORT nvmlReturn_t nvmlDeviceGetBrand(nvmlDevice_t device, unsigned int *brand) {
    DEVICE_ENTER(device, g);
    REQUIRE(brand);
    *brand = g->brand;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetArchitecture(nvmlDevice_t device, unsigned int *arch) {
    DEVICE_ENTER(device, g);
    REQUIRE(arch);
    *arch = g->arch;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    DEVICE_ENTER(device, g);
    REQUIRE(major && minor);
    *major = (int)g->cc_major;
    *minor = (int)g->cc_minor;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEVICE_ENTER(device, g);
    REQUIRE(pci);
    fill_pci_info(pci, &g->pci, g->pci_device_id, g->pci_subsystem_id);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_v1_t *pci) {
    DEVICE_ENTER(device, g);
    REQUIRE(pci);
    if (pci->version != NVML_PCI_INFO_EXT_V1) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memset(pci, 0, sizeof *pci);
    pci->version = NVML_PCI_INFO_EXT_V1;
    pci->domain = g->pci.domain;
    pci->bus = g->pci.bus;
    pci->device = g->pci.dev;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = g->pci_subsystem_id;
    pci->baseClass = 0x3; /* display controller */
    pci->subClass = 0x2;  /* 3D controller, as data-center GPUs report */
    format_bus_ids(&g->pci, NULL, 0, pci->busId, sizeof pci->busId);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *mem) {
    DEVICE_ENTER(device, g);
    REQUIRE(mem);
    /* v1 counts reserved memory as used. */
    mem->total = g->mem_total;
    mem->used = g->mem_used + g->mem_reserved;
    mem->free = g->mem_total > mem->used ? g->mem_total - mem->used : 0;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *mem) {
    DEVICE_ENTER(device, g);
    REQUIRE(mem);
    if (mem->version != NVML_MEMORY_V2) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    u64 busy = g->mem_used + g->mem_reserved;
    mem->total = g->mem_total;
    mem->reserved = g->mem_reserved;
    mem->used = g->mem_used;
    mem->free = g->mem_total > busy ? g->mem_total - busy : 0;
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ NVLink */

#define LINK_ENTER(device, link, g)                                                                          \
    DEVICE_ENTER(device, g);                                                                                 \
    if (g->nlinks == 0) return leave(NVML_ERROR_NOT_SUPPORTED);                                              \
    if ((link) >= g->nlinks) return leave(NVML_ERROR_INVALID_ARGUMENT)

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, unsigned int *isActive) {
    LINK_ENTER(device, link, g);
    REQUIRE(isActive);
    *isActive = g->link[link].active;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link, unsigned int counter,
                                                    unsigned long long *value) {
    LINK_ENTER(device, link, g);
    REQUIRE(value);
    if (counter == 4) return leave(NVML_ERROR_NOT_SUPPORTED); /* DL_ECC_DATA: not simulated */
    REQUIRE(counter < 4);
    *value = g->link[link].err[counter];
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci) {
    LINK_ENTER(device, link, g);
    REQUIRE(pci);
    busid_t zero = {0, 0, 0, 0};
    const busid_t *b = g->link[link].has_remote ? &g->link[link].remote : &zero;
    const gpu_t *peer = g->link[link].has_remote ? gpu_by_bus(b) : NULL;
    fill_pci_info(pci, b, peer ? peer->pci_device_id : 0, peer ? peer->pci_subsystem_id : 0);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link, unsigned int *type) {
    LINK_ENTER(device, link, g);
    REQUIRE(type);
    if (!g->link[link].has_remote)
        *type = NVLINK_DEVICE_TYPE_UNKNOWN;
    else
        *type = gpu_by_bus(&g->link[link].remote) ? NVLINK_DEVICE_TYPE_GPU : NVLINK_DEVICE_TYPE_SWITCH;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkVersion(nvmlDevice_t device, unsigned int link, unsigned int *version) {
    LINK_ENTER(device, link, g);
    REQUIRE(version);
    switch (g->arch) { /* nvmlNvlinkVersion_t */
    case 5: *version = 2; break;  /* Volta: NVLink 2.0 */
    case 7: *version = 4; break;  /* Ampere: 3.0 */
    case 9: *version = 6; break;  /* Hopper: 4.0 */
    case 10: *version = 7; break; /* Blackwell: 5.0 */
    case 13: *version = 8; break; /* Rubin: 6.0 */
    default: return leave(NVML_ERROR_NOT_SUPPORTED);
    }
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ clocks, thermals */

static nvmlReturn_t reasons_impl(const char *fn, nvmlDevice_t device, unsigned long long *reasons, int supported) {
    gpu_t *g;
    nvmlReturn_t rc = enter_device(fn, device, &g);
    if (rc) return rc;
    REQUIRE(reasons);
    *reasons = supported ? g->cer_supported : g->cer_current;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *r) {
    return reasons_impl(__func__, d, r, 0);
}
EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t d, unsigned long long *r) {
    return reasons_impl(__func__, d, r, 0);
}
EXPORT nvmlReturn_t nvmlDeviceGetSupportedClocksEventReasons(nvmlDevice_t d, unsigned long long *r) {
    return reasons_impl(__func__, d, r, 1);
}
EXPORT nvmlReturn_t nvmlDeviceGetSupportedClocksThrottleReasons(nvmlDevice_t d, unsigned long long *r) {
    return reasons_impl(__func__, d, r, 1);
}

EXPORT nvmlReturn_t nvmlDeviceGetViolationStatus(nvmlDevice_t device, unsigned int policy, nvmlViolationTime_t *t) {
    DEVICE_ENTER(device, g);
    REQUIRE(t && policy < 12); /* NVML_PERF_POLICY_COUNT */
    const u64 *ns = kv_get(&g->violation, policy);
    t->referenceTime = now_us();
    t->violationTime = ns ? *ns : 0;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensor, unsigned int *temp) {
    DEVICE_ENTER(device, g);
    REQUIRE(temp && sensor == 0); /* NVML_TEMPERATURE_GPU */
    *temp = g->temp_gpu;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_v1_t *temp) {
    DEVICE_ENTER(device, g);
    REQUIRE(temp);
    if (temp->version != NVML_TEMPERATURE_V1) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    REQUIRE(temp->sensorType == 0);
    temp->temperature = (int)g->temp_gpu;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t device, unsigned int type, unsigned int *temp) {
    DEVICE_ENTER(device, g);
    REQUIRE(temp && type < 8); /* NVML_TEMPERATURE_THRESHOLD_COUNT */
    if (type >= 4) return leave(NVML_ERROR_NOT_SUPPORTED); /* acoustic / GPS thresholds */
    *temp = g->thr[type];
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t clock_impl(const char *fn, nvmlDevice_t device, unsigned int type, unsigned int *mhz, int max) {
    gpu_t *g;
    nvmlReturn_t rc = enter_device(fn, device, &g);
    if (rc) return rc;
    REQUIRE(mhz && type < 4); /* GRAPHICS, SM, MEM, VIDEO; graphics = SM on these parts */
    static const int slot[4] = {0, 0, 1, 2};
    *mhz = max ? g->maxclk[slot[type]] : g->clk[slot[type]];
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t d, unsigned int type, unsigned int *mhz) {
    return clock_impl(__func__, d, type, mhz, 0);
}
EXPORT nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t d, unsigned int type, unsigned int *mhz) {
    return clock_impl(__func__, d, type, mhz, 1);
}

/* One getter for every "device, unsigned int *out" function. */
enum { U_POWER, U_LIMIT, U_PM_LIMIT, U_GEN, U_MAX_GEN, U_WIDTH, U_MAX_WIDTH };
static nvmlReturn_t uint_impl(const char *fn, nvmlDevice_t device, unsigned int *out, int what) {
    gpu_t *g;
    nvmlReturn_t rc = enter_device(fn, device, &g);
    if (rc) return rc;
    REQUIRE(out);
    switch (what) {
    case U_POWER: *out = g->power_mw; break;
    case U_LIMIT:
    case U_PM_LIMIT: *out = g->limit_mw; break;
    case U_GEN: *out = g->pcie_gen; break;
    case U_MAX_GEN: *out = g->pcie_max_gen; break;
    case U_WIDTH: *out = g->pcie_width; break;
    default: *out = g->pcie_max_width; break;
    }
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *mw) { return uint_impl(__func__, d, mw, U_POWER); }
EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned int *mw) {
    return uint_impl(__func__, d, mw, U_LIMIT);
}
EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t d, unsigned int *mw) {
    return uint_impl(__func__, d, mw, U_PM_LIMIT);
}
EXPORT nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t d, unsigned int *v) {
    return uint_impl(__func__, d, v, U_GEN);
}
EXPORT nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t d, unsigned int *v) {
    return uint_impl(__func__, d, v, U_MAX_GEN);
}
EXPORT nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned int *v) {
    return uint_impl(__func__, d, v, U_WIDTH);
}
EXPORT nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned int *v) {
    return uint_impl(__func__, d, v, U_MAX_WIDTH);
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util) {
    DEVICE_ENTER(device, g);
    REQUIRE(util);
    util->gpu = g->util_gpu;
    util->memory = g->util_mem;
    return leave(NVML_SUCCESS);
}

#define PCIE_UTIL_TX_BYTES 0 /* nvmlPcieUtilCounter_t */
#define PCIE_UTIL_RX_BYTES 1
EXPORT nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t device, unsigned int counter, unsigned int *value) {
    DEVICE_ENTER(device, g);
    REQUIRE(value);
    if (counter == PCIE_UTIL_TX_BYTES)
        *value = g->pcie_tx_kbps;
    else if (counter == PCIE_UTIL_RX_BYTES)
        *value = g->pcie_rx_kbps;
    else
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ field values */

static void field_value(const gpu_t *g, nvmlFieldValue_t *v, u64 ts) {
    u64 val = 0;
    unsigned int type = VALUE_TYPE_ULL;
    nvmlReturn_t ret = NVML_SUCCESS;
    int link_total = -1; /* NVLink error counter summed over links */
    switch (v->fieldId) {
    case 3: val = g->ecc[0]; break;  /* NVML_FI_DEV_ECC_SBE_VOL_TOTAL */
    case 4: val = g->ecc[1]; break;  /* ..._DBE_VOL_TOTAL */
    case 5: val = g->ecc[2]; break;  /* ..._SBE_AGG_TOTAL */
    case 6: val = g->ecc[3]; break;  /* ..._DBE_AGG_TOTAL */
    case 29:                         /* NVML_FI_DEV_RETIRED_SBE */
    case 30:                         /* NVML_FI_DEV_RETIRED_DBE */
        if (g->retired[v->fieldId - 29] < 0) ret = NVML_ERROR_NOT_SUPPORTED;
        else val = (u64)g->retired[v->fieldId - 29];
        break;
    case 31: /* NVML_FI_DEV_RETIRED_PENDING */
        if (g->retired[0] < 0 && g->retired[1] < 0) ret = NVML_ERROR_NOT_SUPPORTED;
        else val = g->retired_pending;
        break;
    case 38: link_total = 2; break; /* NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL */
    case 45: link_total = 3; break; /* ..._CRC_DATA_ERROR_COUNT_TOTAL */
    case 52: link_total = 0; break; /* ..._REPLAY_ERROR_COUNT_TOTAL */
    case 59: link_total = 1; break; /* ..._RECOVERY_ERROR_COUNT_TOTAL */
    case 82:                        /* NVML_FI_DEV_MEMORY_TEMP */
        type = VALUE_TYPE_UINT;
        if (g->temp_mem < 0) ret = NVML_ERROR_NOT_SUPPORTED;
        else val = (u64)g->temp_mem;
        break;
    case 91: /* NVML_FI_DEV_NVLINK_LINK_COUNT */
        type = VALUE_TYPE_UINT;
        if (g->nlinks == 0) ret = NVML_ERROR_NOT_SUPPORTED;
        else val = g->nlinks;
        break;
    case 142: /* NVML_FI_DEV_REMAPPED_COR, _UNC, _PENDING, _FAILURE */
    case 143:
    case 144:
    case 145:
        type = VALUE_TYPE_UINT;
        val = g->remap[v->fieldId - 142];
        break;
    case 186: /* NVML_FI_DEV_POWER_INSTANT (mW) */
        type = VALUE_TYPE_UINT;
        val = g->power_mw;
        break;
    default: ret = NVML_ERROR_NOT_SUPPORTED; break;
    }
    if (link_total >= 0) {
        if (g->nlinks == 0) ret = NVML_ERROR_NOT_SUPPORTED;
        for (unsigned int l = 0; l < g->nlinks; l++) val += g->link[l].err[link_total];
    }
    v->timestamp = (long long)ts;
    v->latencyUsec = 0;
    v->valueType = type;
    v->nvmlReturn = ret;
    memset(&v->value, 0, sizeof v->value);
    v->value.ullVal = ret == NVML_SUCCESS ? val : 0; /* little-endian: uiVal/siVal read the same number */
}

EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount, nvmlFieldValue_t *values) {
    DEVICE_ENTER(device, g);
    REQUIRE(values && valuesCount > 0);
    u64 ts = now_us();
    for (int i = 0; i < valuesCount; i++) field_value(g, &values[i], ts);
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ memory errors */

EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    DEVICE_ENTER(device, g);
    REQUIRE(current && pending);
    *current = g->ecc_cur;
    *pending = g->ecc_pend;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType, unsigned int counterType,
                                                unsigned long long *count) {
    DEVICE_ENTER(device, g);
    REQUIRE(count && errorType < 2 && counterType < 2);
    if (!g->ecc_cur) return leave(NVML_ERROR_NOT_SUPPORTED); /* ECC disabled: no counters */
    *count = g->ecc[counterType * 2 + errorType];
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                              unsigned int *isPending, unsigned int *failureOccurred) {
    DEVICE_ENTER(device, g);
    REQUIRE(corrRows && uncRows && isPending && failureOccurred);
    *corrRows = g->remap[0];
    *uncRows = g->remap[1];
    *isPending = g->remap[2];
    *failureOccurred = g->remap[3];
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetRowRemapperHistogram(nvmlDevice_t device, nvmlRowRemapperHistogramValues_t *v) {
    DEVICE_ENTER(device, g);
    REQUIRE(v);
    v->max = g->hist[0];
    v->high = g->hist[1];
    v->partial = g->hist[2];
    v->low = g->hist[3];
    v->none = g->hist[4];
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t retired_impl(const char *fn, nvmlDevice_t device, unsigned int cause, unsigned int *count,
                                 unsigned long long *addresses, unsigned long long *timestamps) {
    gpu_t *g;
    nvmlReturn_t rc = enter_device(fn, device, &g);
    if (rc) return rc;
    REQUIRE(count && cause < 2); /* NVML_PAGE_RETIREMENT_CAUSE_COUNT */
    if (g->retired[cause] < 0) return leave(NVML_ERROR_NOT_SUPPORTED);
    unsigned int n = (unsigned int)g->retired[cause];
    if (*count < n) {
        *count = n;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    REQUIRE(n == 0 || addresses);
    u64 now = now_us();
    for (unsigned int i = 0; i < n; i++) { /* synthetic page addresses, distinct per cause */
        addresses[i] = 0x100000ULL + (u64)cause * 0x80000ULL + (u64)i * 0x10ULL;
        if (timestamps) timestamps[i] = now;
    }
    *count = n;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t d, unsigned int cause, unsigned int *count,
                                              unsigned long long *addresses) {
    return retired_impl(__func__, d, cause, count, addresses, NULL);
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t d, unsigned int cause, unsigned int *count,
                                                 unsigned long long *addresses, unsigned long long *timestamps) {
    return retired_impl(__func__, d, cause, count, addresses, timestamps);
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, unsigned int *isPending) {
    DEVICE_ENTER(device, g);
    REQUIRE(isPending);
    if (g->retired[0] < 0 && g->retired[1] < 0) return leave(NVML_ERROR_NOT_SUPPORTED);
    *isPending = g->retired_pending;
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ fabric, topology */

EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *info) {
    DEVICE_ENTER(device, g);
    REQUIRE(info);
    if (g->arch < ARCH_HOPPER) return leave(NVML_ERROR_NOT_SUPPORTED);
    memcpy(info->clusterUuid, g->fabric_uuid, 16);
    info->status = g->fabric_status;
    info->cliqueId = g->fabric_clique;
    info->state = g->fabric_state;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfo_v3_t *info) {
    DEVICE_ENTER(device, g);
    REQUIRE(info);
    unsigned int version = info->version;
    if (version != NVML_FABRIC_INFO_V2 && version != NVML_FABRIC_INFO_V3)
        return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    if (g->arch < ARCH_HOPPER) return leave(NVML_ERROR_NOT_SUPPORTED);
    nvmlGpuFabricInfo_v2_t *v2 = (nvmlGpuFabricInfo_v2_t *)info; /* common prefix of v2 and v3 */
    memcpy(v2->clusterUuid, g->fabric_uuid, 16);
    v2->status = g->fabric_status;
    v2->cliqueId = g->fabric_clique;
    v2->state = g->fabric_state;
    v2->healthMask = g->fabric_health;
    if (version == NVML_FABRIC_INFO_V3) info->healthSummary = (unsigned char)g->fabric_summary;
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t peer_index(nvmlDevice_t peer, unsigned int *idx) {
    if (handle_index(peer, idx) != 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (*idx >= g_state->ngpus) return NVML_ERROR_GPU_IS_LOST;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2, unsigned int p2pIndex,
                                           unsigned int *status) {
    DEVICE_ENTER(device1, g);
    unsigned int peer;
    nvmlReturn_t rc = peer_index(device2, &peer);
    if (rc) return leave(rc);
    REQUIRE(status && p2pIndex < P2P_CAPS_INDEX_UNKNOWN);
    const u64 *s = kv_get(&g->p2p, peer);
    if (s)
        *status = (unsigned int)*s;
    else if (p2pIndex == P2P_CAPS_INDEX_NVLINK && (g->nlinks == 0 || g_state->gpu[peer].nlinks == 0))
        *status = P2P_STATUS_NOT_SUPPORTED;
    else
        *status = 0; /* NVML_P2P_STATUS_OK */
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                        unsigned int *level) {
    DEVICE_ENTER(device1, g);
    unsigned int peer;
    nvmlReturn_t rc = peer_index(device2, &peer);
    if (rc) return leave(rc);
    REQUIRE(level);
    const u64 *l = kv_get(&g->topo, peer);
    if (l)
        *level = (unsigned int)*l;
    else if (peer == gpu_index(g))
        *level = TOPOLOGY_INTERNAL;
    else
        *level = g->numa == g_state->gpu[peer].numa ? TOPOLOGY_NODE : TOPOLOGY_SYSTEM;
    return leave(NVML_SUCCESS);
}

/* ------------------------------------------------------------------------------------ processes */

static nvmlReturn_t processes_impl(const char *fn, nvmlDevice_t device, unsigned int *infoCount,
                                   nvmlProcessInfo_v2_t *infos) {
    gpu_t *g;
    nvmlReturn_t rc = enter_device(fn, device, &g);
    if (rc) return rc;
    REQUIRE(infoCount);
    unsigned int n = g->nprocs;
    if (*infoCount < n) {
        *infoCount = n;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    REQUIRE(n == 0 || infos);
    for (unsigned int i = 0; i < n; i++) {
        infos[i].pid = g->proc[i].pid;
        infos[i].usedGpuMemory = g->proc[i].used;
        infos[i].gpuInstanceId = MIG_ID_NONE;
        infos[i].computeInstanceId = MIG_ID_NONE;
    }
    *infoCount = n;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *infoCount,
                                                            nvmlProcessInfo_v2_t *infos) {
    return processes_impl(__func__, d, infoCount, infos);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *infoCount,
                                                            nvmlProcessInfo_v2_t *infos) {
    return processes_impl(__func__, d, infoCount, infos);
}

/* ------------------------------------------------------------------------------------ events */

static int event_set_ok(nvmlEventSet_t set) { return set && set->magic == EVENT_SET_MAGIC; }

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    nvmlReturn_t rc = enter_system(__func__);
    if (rc) return rc;
    REQUIRE(set);
    nvmlEventSet_t s = calloc(1, sizeof *s);
    if (!s) return leave(NVML_ERROR_MEMORY);
    s->magic = EVENT_SET_MAGIC;
    *set = s;
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    nvmlReturn_t rc = enter_system(__func__);
    if (rc) return rc;
    REQUIRE(event_set_ok(set));
    set->magic = 0;
    free(set->delivered);
    free(set);
    return leave(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *types) {
    DEVICE_ENTER(device, g);
    REQUIRE(types);
    *types = g->supported_events;
    return leave(NVML_SUCCESS);
}

static int was_delivered(nvmlEventSet_t set, unsigned int gpu, u64 seq) {
    for (size_t i = 0; i < set->ndelivered; i++)
        if (set->delivered[i].gpu == gpu && set->delivered[i].seq == seq) return 1;
    return 0;
}

static nvmlReturn_t mark_delivered(nvmlEventSet_t set, unsigned int gpu, u64 seq) {
    if (set->ndelivered == set->cap) {
        size_t cap = set->cap ? set->cap * 2 : 64;
        void *p = realloc(set->delivered, cap * sizeof set->delivered[0]);
        if (!p) return NVML_ERROR_MEMORY;
        set->delivered = p;
        set->cap = cap;
    }
    set->delivered[set->ndelivered].gpu = gpu;
    set->delivered[set->ndelivered].seq = seq;
    set->ndelivered++;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set) {
    DEVICE_ENTER(device, g);
    REQUIRE(event_set_ok(set));
    if (types & ~g->supported_events) return leave(NVML_ERROR_NOT_SUPPORTED);
    unsigned int gi = gpu_index(g);
    if ((types & EVENT_TYPE_XID) && !(set->mask[gi] & EVENT_TYPE_XID)) {
        /* Like the real driver: a set only reports events that happen after it registered. */
        for (unsigned int k = 0; k < g->nxids; k++) {
            if (was_delivered(set, gi, g->xid[k].seq)) continue;
            nvmlReturn_t rc = mark_delivered(set, gi, g->xid[k].seq);
            if (rc != NVML_SUCCESS) return leave(rc);
        }
    }
    set->mask[gi] |= types;
    return leave(NVML_SUCCESS);
}

/* Delivers the undelivered Xid with the lowest seq (then lowest GPU index). g_mu held. */
static nvmlReturn_t deliver_locked(nvmlEventSet_t set, nvmlEventData_t *data, int *found) {
    int best_gpu = -1;
    unsigned int best_xid = 0;
    *found = 0;
    for (unsigned int i = 0; i < g_state->ngpus; i++) {
        if (!(set->mask[i] & EVENT_TYPE_XID)) continue;
        const gpu_t *g = &g_state->gpu[i];
        for (unsigned int k = 0; k < g->nxids; k++) {
            if (best_gpu >= 0 && g->xid[k].seq >= g_state->gpu[best_gpu].xid[best_xid].seq) continue;
            if (was_delivered(set, i, g->xid[k].seq)) continue;
            best_gpu = (int)i;
            best_xid = k;
        }
    }
    if (best_gpu < 0) return NVML_SUCCESS;
    const gpu_t *g = &g_state->gpu[best_gpu];
    nvmlReturn_t rc = mark_delivered(set, (unsigned int)best_gpu, g->xid[best_xid].seq);
    if (rc != NVML_SUCCESS) return rc;
    memset(data, 0, sizeof *data);
    data->device = &g_devices[best_gpu];
    data->eventType = EVENT_TYPE_XID;
    data->eventData = g->xid[best_xid].code;
    data->gpuInstanceId = 0xFFFFFFFFu; /* not attributable to a MIG instance */
    data->computeInstanceId = 0xFFFFFFFFu;
    *found = 1;
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    nvmlReturn_t rc = enter_system(__func__);
    if (rc) return rc;
    REQUIRE(event_set_ok(set) && data);
    for (;;) {
        int found;
        rc = deliver_locked(set, data, &found);
        if (rc || found) return leave(rc);
        pthread_mutex_unlock(&g_mu);
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long elapsed_ms = (long long)(now.tv_sec - start.tv_sec) * 1000LL +
                               (long long)(now.tv_nsec - start.tv_nsec) / 1000000LL;
        if (elapsed_ms >= (long long)timeoutms) return NVML_ERROR_TIMEOUT;
        u64 left = (u64)((long long)timeoutms - elapsed_ms);
        sleep_us((left < 10 ? left : 10) * 1000ULL);
        rc = lock_initialized();
        if (rc) return rc;
        if (!event_set_ok(set)) return leave(NVML_ERROR_INVALID_ARGUMENT);
    }
}
