/*
 * fake_nvml.c - a fake libnvidia-ml.so.1 for gpudiag's tests.
 *
 * Build: gcc -std=c11 -shared -fPIC -fvisibility=hidden
 *            -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c -lpthread
 *
 * It implements the subset of the NVML C API that gpudiag (through the real
 * nvidia-ml-py `pynvml` bindings) and the fake nvidia-smi use, with struct
 * layouts matching nvml.h / pynvml.  Symbols not implemented here are absent,
 * so pynvml raises NVMLError_FunctionNotFound for them, as with an old driver.
 * Every call made before nvmlInit answers NVML_ERROR_UNINITIALIZED, except
 * nvmlErrorString and nvmlSystemGetNVMLVersion (which nvidia-smi prints after
 * a failed init, as the real library allows).
 *
 * Knobs (environment, overridden by FAKE_GPU_STATE_FILE; see fake_common.h):
 *   FAKE_NVML_DEVICE_COUNT            number of GPUs (default 8, 0..64)
 *   FAKE_NVML_INIT_ERROR=<code>       nvmlInit* returns this nvmlReturn_t
 *   FAKE_NVML_INIT_HANG=1             nvmlInit* never returns
 *   FAKE_NVML_INIT_CRASH=1            nvmlInit* raises SIGSEGV
 *   FAKE_NVML_DEVICE_ERRORS=IDX:CODE  handle lookup and every query on IDX fail
 *   FAKE_NVML_UNSUPPORTED=f1,f2       listed query families return NOT_SUPPORTED:
 *       power, temperature, utilization, ecc, remapped_rows, retired_pages,
 *       clocks_event_reasons, persistence, compute_mode, mig, field_values,
 *       processes, events, memory, pcie, nvlink, fabric, serial, energy, clocks,
 *       firmware
 *   FAKE_GPU_MEMORY_TOTAL_MIB, FAKE_NVML_MEMORY_USED_MIB=IDX[.J]:MIB
 *   FAKE_NVML_UTILIZATION=IDX:PCT, FAKE_NVML_MEMORY_UTILIZATION=IDX:PCT
 *   FAKE_NVML_TEMPERATURE_C=IDX:C (35), FAKE_NVML_POWER_MW=IDX:MW (75000),
 *   FAKE_NVML_POWER_LIMIT_MW=IDX:MW (700000)
 *   FAKE_NVML_CLOCKS_MHZ=IDX:SM/MEM (1980/3201), FAKE_NVML_PSTATE=IDX:N (0),
 *   FAKE_NVML_FAN_PCT=IDX:PCT (unset: NOT_SUPPORTED, a chassis-cooled GPU)
 *   FAKE_NVML_ECC_{VOLATILE,AGGREGATE}_{CORRECTED,UNCORRECTED}=IDX:N
 *   FAKE_NVML_REMAPPED_ROWS=IDX:CORR/UNCORR/PENDING/FAILURE
 *   FAKE_NVML_RETIRED_PAGES=IDX:N     (otherwise retired pages: NOT_SUPPORTED)
 *   FAKE_NVML_CLOCKS_EVENT_REASONS=IDX:MASK
 *   FAKE_NVML_PERSISTENCE=IDX:0|1 (1), FAKE_NVML_COMPUTE_MODE=IDX:N (0)
 *   FAKE_NVML_MIG=IDX:COUNT
 *   FAKE_NVML_RECOVERY_ACTION=IDX:N   field 230 of nvmlDeviceGetFieldValues
 *   FAKE_NVML_LINK_KBPS=IDX:KBPS      field 197 (PCIe TX bytes) grows at KBPS kB/s of the
 *       wall clock (unset: NOT_SUPPORTED, as NVLink's 138/139 always are here)
 *   FAKE_NVML_PROCESSES=IDX[.J]:PID:USED_MIB,...
 *   FAKE_NVML_GRAPHICS_PROCESSES=IDX:PID:USED_MIB,...  (graphics clients, _v3)
 *   FAKE_NVML_PCIE=IDX:CURGEN/MAXGEN/CURWIDTH/MAXWIDTH (5/5/16/16): the PCIe link
 *   FAKE_NVML_NVLINKS=IDX:N           NVLink links per GPU (0: NOT_SUPPORTED, a PCIe GPU)
 *   FAKE_NVML_NVLINK_DOWN=IDX:L/L...  those links report inactive
 *   FAKE_NVML_NVLINK_PEERS=IDX:P[/P...]  where GPU IDX's links end: link L at GPU P (the
 *       L mod n-th of the list: 0:1 a pair, 0:1/2 a ring); `switch` (also the default of a GPU
 *       with links and no entry: an HGX baseboard) an NVSwitch, switch L mod 4 (bus C0..C3).
 *       Families nvlink_remote (remote PCI info and device type NOT_SUPPORTED) and
 *       nvlink_remote_type (the type answers FUNCTION_NOT_FOUND: a driver before the call)
 *   FAKE_NVML_FABRIC=IDX:STATE/STATUS fabric state (0 not supported, 1 not started,
 *       2 in progress, 3 completed) and status (an nvmlReturn_t); unset: NOT_SUPPORTED
 *   FAKE_NVML_RETIRED_PAGES_PENDING=IDX:0|1  pages waiting for a reset to retire
 *   FAKE_NVML_XIDS=IDX[.J]:XID,...    XID events, a multiset: what it lists beyond what this
 *       process delivered is delivered (a new XID written into the state file arrives; one
 *       already delivered arrives again only when listed once more: 3:79,3:79)
 *   FAKE_NVML_XID_STORM=IDX:XID*COUNT,...  an XID storm: COUNT events of XID on GPU IDX per
 *       entry (by position), the entries interleaved round-robin; FAKE_NVML_XIDS' pending
 *       events go first, so a fatal XID written into the state file mid-storm arrives next
 *   FAKE_NVML_XID_STORM_RATE=N        storm events per second (unset or 0: as fast as asked)
 *   FAKE_NVML_SERIAL=IDX:SERIAL       the board serial of GPU IDX (default 16500000000NN,
 *       NN the index); a GPU moved to another slot keeps its serial: give it to the new index
 *   FAKE_NVML_ENERGY_MJ=IDX:MJ        total energy counter in millijoules; unset, it is the
 *       GPU's power (FAKE_NVML_POWER_MW) times the wall clock's seconds, so that it grows at
 *       the board's power and agrees across processes
 *   FAKE_NVML_DRIVER_VERSION (570.124.06), FAKE_CUDA_DRIVER_VERSION (12080)
 *   The inventory (gpu_config_drift, diagnostic_side_effect), each per GPU:
 *   FAKE_NVML_VBIOS=IDX:TEXT (96.00.9F.00.04), FAKE_NVML_INFOROM=IDX:TEXT (G525.0230.00.01),
 *   FAKE_NVML_GSP_FIRMWARE=IDX:TEXT (the driver version), all three of family "firmware";
 *   FAKE_NVML_APP_CLOCKS_MHZ=IDX:SM/MEM (1980/3201) the application clocks (family clocks);
 *   FAKE_NVML_ECC_MODE=IDX:CUR[/PENDING] (1/1) ECC mode now and after the next reset;
 *   the power management limit is FAKE_NVML_POWER_LIMIT_MW's (family power)
 * FAKE_NVML_COMPUTE_MODE, FAKE_NVML_PROCESSES and FAKE_NVML_MEMORY_USED_MIB also
 * decide whether the fake libcuda creates a context on a GPU (see fake_cuda.c).
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdatomic.h>
#include <unistd.h>

#include "fake_common.h"

/* ------------------------------------------------------------------------- */
/* Types from nvml.h (layouts checked against nvidia-ml-py 13.615)           */
/* ------------------------------------------------------------------------- */

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu

/* A device handle points at one of these. */
typedef struct fake_nvml_device {
    int gpu; /* parent GPU index */
    int mig; /* MIG instance index, -1 for the full GPU */
} fake_nvml_device;
typedef fake_nvml_device *nvmlDevice_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t; /* 24 bytes */

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t; /* 40 bytes */
#define NVML_MEMORY_V2_VERSION 0x02000028u

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

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
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType; /* nvmlValueType_t */
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t; /* 40 bytes */

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t; /* v2 == v3 layout, 24 bytes */

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t layout");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t layout");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t layout");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t layout");
_Static_assert(sizeof(nvmlEventData_t) == 32, "nvmlEventData_t layout");

#define NVML_VALUE_TYPE_UNSIGNED_INT 1
#define NVML_VALUE_TYPE_UNSIGNED_LONG_LONG 3
#define NVML_NVLINK_MAX_LINKS 18 /* the 535 nvml.h's bound (newer headers: 36); FAKE_NVML_NVLINKS caps here */

/* nvmlGpuFabricInfo_t (v1, nvmlDeviceGetGpuFabricInfo) and _v2_t (nvmlDeviceGetGpuFabricInfoV). */
typedef struct {
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
} nvmlGpuFabricInfo_t; /* 28 bytes */

typedef struct {
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
    unsigned int healthMask;
} nvmlGpuFabricInfo_v2_t; /* 36 bytes */
#define NVML_GPU_FABRIC_INFO_V2_VERSION 0x02000024u
_Static_assert(sizeof(nvmlGpuFabricInfo_t) == 28, "nvmlGpuFabricInfo_t layout");
_Static_assert(sizeof(nvmlGpuFabricInfo_v2_t) == 36, "nvmlGpuFabricInfo_v2_t layout");
#define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230
#define NVML_FI_DEV_PCIE_COUNT_TX_BYTES 197

#define nvmlEventTypeSingleBitEccError 0x1ULL
#define nvmlEventTypeDoubleBitEccError 0x2ULL
#define nvmlEventTypePState 0x4ULL
#define nvmlEventTypeXidCriticalError 0x8ULL
#define nvmlEventTypeClock 0x10ULL
#define FAKE_SUPPORTED_EVENTS                                                                  \
    (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypePState | \
     nvmlEventTypeXidCriticalError | nvmlEventTypeClock)

/* ------------------------------------------------------------------------- */
/* Library state                                                             */
/* ------------------------------------------------------------------------- */

static fake_nvml_device g_gpus[FAKE_MAX_GPUS];
static fake_nvml_device g_migs[FAKE_MAX_GPUS][FAKE_MAX_MIG];
static atomic_int g_init_count;

static void fake_nvml_setup_handles(void) {
    for (int i = 0; i < FAKE_MAX_GPUS; i++) {
        g_gpus[i].gpu = i;
        g_gpus[i].mig = -1;
        for (int j = 0; j < FAKE_MAX_MIG; j++) {
            g_migs[i][j].gpu = i;
            g_migs[i][j].mig = j;
        }
    }
}

static int device_count(void) {
    long long n = fake_get_ll("FAKE_NVML_DEVICE_COUNT", FAKE_DEFAULT_GPU_COUNT);
    if (n < 0) n = 0;
    if (n > FAKE_MAX_GPUS) n = FAKE_MAX_GPUS;
    return (int)n;
}

/* Error injected for GPU i by FAKE_NVML_DEVICE_ERRORS, 0 when healthy. */
static nvmlReturn_t device_error(int gpu) {
    return (nvmlReturn_t)fake_list_ll("FAKE_NVML_DEVICE_ERRORS", gpu, -1, 0);
}

/* True when `family` is listed in FAKE_NVML_UNSUPPORTED. */
static int unsupported(const char *family) {
    char *v = fake_get_dup("FAKE_NVML_UNSUPPORTED");
    int hit = 0;
    char *save = NULL;
    for (char *tok = v ? strtok_r(v, ",", &save) : NULL; tok; tok = strtok_r(NULL, ",", &save)) {
        if (strcmp(fake_strip(tok), family) == 0) {
            hit = 1;
            break;
        }
    }
    free(v);
    return hit;
}

/* Handle validation: a pointer into g_gpus / g_migs naming an existing device. */
static int handle_valid(nvmlDevice_t d) {
    uintptr_t p = (uintptr_t)d;
    uintptr_t gpus = (uintptr_t)g_gpus, migs = (uintptr_t)g_migs;
    if (p >= gpus && p < gpus + sizeof g_gpus && (p - gpus) % sizeof g_gpus[0] == 0)
        return d->gpu < device_count();
    if (p >= migs && p < migs + sizeof g_migs && (p - migs) % sizeof g_migs[0][0] == 0)
        return d->gpu < device_count() && d->mig < fake_mig_count(d->gpu);
    return 0;
}

/*
 * Common prologue of every per-device query: library initialised, handle
 * valid, no injected device error, family supported, and (for full-GPU-only
 * queries) not a MIG handle.
 */
static nvmlReturn_t check_device(nvmlDevice_t d, const char *family, int mig_ok) {
    if (atomic_load(&g_init_count) <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!handle_valid(d)) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t err = device_error(d->gpu);
    if (err) return err;
    if (family && unsupported(family)) return NVML_ERROR_NOT_SUPPORTED;
    if (!mig_ok && d->mig >= 0) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

#define CHECK_DEVICE(d, family, mig_ok)                             \
    do {                                                            \
        nvmlReturn_t rc_ = check_device((d), (family), (mig_ok));  \
        if (rc_ != NVML_SUCCESS) return rc_;                        \
    } while (0)

#define CHECK_INIT()                                                                  \
    do {                                                                              \
        if (atomic_load(&g_init_count) <= 0) return NVML_ERROR_UNINITIALIZED;        \
    } while (0)

static nvmlReturn_t copy_string(char *dst, unsigned int len, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------- */
/* Init / shutdown / errors                                                  */
/* ------------------------------------------------------------------------- */

static nvmlReturn_t do_init(void) {
    if (fake_get_flag("FAKE_NVML_INIT_HANG")) fake_hang_forever();
    if (fake_get_flag("FAKE_NVML_INIT_CRASH")) raise(SIGSEGV);
    nvmlReturn_t err = (nvmlReturn_t)fake_get_ll("FAKE_NVML_INIT_ERROR", 0);
    if (err != NVML_SUCCESS) return err;
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, fake_nvml_setup_handles);
    atomic_fetch_add(&g_init_count, 1);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init();
}
FAKE_EXPORT nvmlReturn_t nvmlInit_v2(void) { return do_init(); }
FAKE_EXPORT nvmlReturn_t nvmlInit(void) { return do_init(); }

FAKE_EXPORT nvmlReturn_t nvmlShutdown(void) {
    int cur = atomic_load(&g_init_count);
    while (cur > 0) {
        if (atomic_compare_exchange_weak(&g_init_count, &cur, cur - 1)) return NVML_SUCCESS;
    }
    return NVML_ERROR_UNINITIALIZED;
}

/* The strings the real libnvidia-ml returns (0..27 checked against NVIDIA's 535 library by
 * tests/test_real_nvidia.py; 28.. are newer than 535, which answers "Unknown Error"). */
FAKE_EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires reset";
    case 17: return "GPU access blocked by the operating system";
    case 18: return "Driver/library version mismatch";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "vGPU ECC not supported";
    case 23: return "Insufficient Resources";
    case 24: return "Invalid Frequency";
    case 25: return "Argument version mismatch";
    case 26: return "Requested functionality has been deprecated";
    case 27: return "System is not in ready state";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    case 30: return "Reset type not supported";
    default: return "Unknown Error";
    }
}

/* ------------------------------------------------------------------------- */
/* System queries                                                            */
/* ------------------------------------------------------------------------- */

static void driver_version(char *buf, size_t len) {
    fake_get_str("FAKE_NVML_DRIVER_VERSION", FAKE_DEFAULT_DRIVER_VERSION, buf, len);
}

FAKE_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    CHECK_INIT();
    char buf[80];
    driver_version(buf, sizeof buf);
    return copy_string(version, length, buf);
}

/* Works before nvmlInit, like the real one (nvidia-smi uses it on failure). */
FAKE_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    char buf[80], out[128];
    driver_version(buf, sizeof buf);
    long long cuda = fake_get_ll("FAKE_CUDA_DRIVER_VERSION", FAKE_DEFAULT_CUDA_VERSION);
    snprintf(out, sizeof out, "%lld.%s", cuda / 1000, buf);
    return copy_string(version, length, out);
}

FAKE_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    CHECK_INIT();
    if (!version) return NVML_ERROR_INVALID_ARGUMENT;
    *version = (int)fake_get_ll("FAKE_CUDA_DRIVER_VERSION", FAKE_DEFAULT_CUDA_VERSION);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) {
    return nvmlSystemGetCudaDriverVersion(version);
}

/* ------------------------------------------------------------------------- */
/* Enumeration and identity                                                  */
/* ------------------------------------------------------------------------- */

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    CHECK_INIT();
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)device_count();
    return NVML_SUCCESS;
}
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    CHECK_INIT();
    if (!device || index >= (unsigned int)device_count()) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t err = device_error((int)index);
    if (err) return err;
    *device = &g_gpus[index];
    return NVML_SUCCESS;
}
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    CHECK_INIT();
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    char buf[96];
    int n = device_count();
    for (int i = 0; i < n; i++) {
        nvmlDevice_t found = NULL;
        fake_gpu_uuid(i, buf, sizeof buf);
        if (strcasecmp(buf, uuid) == 0) found = &g_gpus[i];
        for (int j = 0; !found && j < fake_mig_count(i); j++) {
            fake_mig_uuid(i, j, buf, sizeof buf);
            if (strcasecmp(buf, uuid) == 0) found = &g_migs[i][j];
        }
        if (found) {
            nvmlReturn_t err = device_error(i);
            if (err) return err;
            *device = found;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    CHECK_DEVICE(device, NULL, 0);
    if (!index) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)device->gpu;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    CHECK_DEVICE(device, NULL, 0);
    if (!minor) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = (unsigned int)device->gpu;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    CHECK_DEVICE(device, NULL, 1);
    char buf[96];
    if (device->mig >= 0)
        fake_mig_uuid(device->gpu, device->mig, buf, sizeof buf);
    else
        fake_gpu_uuid(device->gpu, buf, sizeof buf);
    return copy_string(uuid, length, buf);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t device, char *serial, unsigned int length) {
    CHECK_DEVICE(device, "serial", 0);
    char buf[64];
    if (!fake_list_str("FAKE_NVML_SERIAL", device->gpu, -1, buf, sizeof buf))
        snprintf(buf, sizeof buf, "16500000000%02d", device->gpu);
    return copy_string(serial, length, buf);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    CHECK_DEVICE(device, NULL, 1);
    char buf[128];
    if (device->mig >= 0)
        fake_mig_name(device->gpu, buf, sizeof buf);
    else
        fake_gpu_name(buf, sizeof buf);
    return copy_string(name, length, buf);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    CHECK_DEVICE(device, NULL, 1);
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    int bus = fake_pci_bus(device->gpu);
    pci->domain = 0;
    pci->bus = (unsigned int)bus;
    pci->device = 0;
    pci->pciDeviceId = 0x233510DEu;    /* H200 SXM */
    pci->pciSubSystemId = 0x18BE10DEu;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", bus);
    return NVML_SUCCESS;
}
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

/* ------------------------------------------------------------------------- */
/* Memory, utilisation, temperature, power                                   */
/* ------------------------------------------------------------------------- */

static void memory_of(nvmlDevice_t d, unsigned long long *total, unsigned long long *used) {
    unsigned long long total_mib =
        d->mig >= 0 ? fake_mig_memory_total_mib(d->gpu) : fake_gpu_memory_total_mib();
    long long used_mib = fake_list_ll("FAKE_NVML_MEMORY_USED_MIB", d->gpu, d->mig, 0);
    if (used_mib < 0) used_mib = 0;
    if ((unsigned long long)used_mib > total_mib) used_mib = (long long)total_mib;
    *total = total_mib * FAKE_MIB;
    *used = (unsigned long long)used_mib * FAKE_MIB;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    CHECK_DEVICE(device, "memory", 1);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long total, used;
    memory_of(device, &total, &used);
    memory->total = total;
    memory->used = used;
    memory->free = total - used;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    CHECK_DEVICE(device, "memory", 1);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2_VERSION) return 25; /* ARGUMENT_VERSION_MISMATCH */
    unsigned long long total, used;
    memory_of(device, &total, &used);
    memory->total = total;
    memory->reserved = 0;
    memory->used = used;
    memory->free = total - used;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *util) {
    CHECK_DEVICE(device, "utilization", 0);
    if (!util) return NVML_ERROR_INVALID_ARGUMENT;
    util->gpu = (unsigned int)fake_list_ll("FAKE_NVML_UTILIZATION", device->gpu, -1, 0);
    util->memory = (unsigned int)fake_list_ll("FAKE_NVML_MEMORY_UTILIZATION", device->gpu, -1, 0);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) {
    CHECK_DEVICE(device, "temperature", 0);
    if (!temp || sensor != 0 /* NVML_TEMPERATURE_GPU */) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = (unsigned int)fake_list_ll("FAKE_NVML_TEMPERATURE_C", device->gpu, -1, 35);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    CHECK_DEVICE(device, "power", 0);
    if (!power) return NVML_ERROR_INVALID_ARGUMENT;
    *power = (unsigned int)fake_list_ll("FAKE_NVML_POWER_MW", device->gpu, -1, 75000);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t device,
                                                              unsigned long long *energy) {
    CHECK_DEVICE(device, "energy", 0);
    if (!energy) return NVML_ERROR_INVALID_ARGUMENT;
    long long fixed = fake_list_ll("FAKE_NVML_ENERGY_MJ", device->gpu, -1, -1);
    if (fixed >= 0) {
        *energy = (unsigned long long)fixed;
        return NVML_SUCCESS;
    }
    long long mw = fake_list_ll("FAKE_NVML_POWER_MW", device->gpu, -1, 75000);
    /* mW x s = mJ: the counter grows at the board's power, the same in every process. */
    *energy = (unsigned long long)((double)mw * ((double)fake_now_us() / 1e6));
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit) {
    CHECK_DEVICE(device, "power", 0);
    if (!limit) return NVML_ERROR_INVALID_ARGUMENT;
    *limit = (unsigned int)fake_list_ll("FAKE_NVML_POWER_LIMIT_MW", device->gpu, -1, 700000);
    return NVML_SUCCESS;
}

/* What nvidia-smi users scan for: clocks, performance state, fan. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t device, int type,
                                                unsigned int *clock) {
    CHECK_DEVICE(device, "clocks", 0);
    if (!clock) return NVML_ERROR_INVALID_ARGUMENT;
    char buf[64];
    long long sm = 1980, mem = 3201; /* an H200 at its boost and memory clocks */
    if (fake_list_str("FAKE_NVML_CLOCKS_MHZ", device->gpu, -1, buf, sizeof buf))
        sscanf(buf, "%lld/%lld", &sm, &mem);
    if (type == 1) *clock = (unsigned int)sm;         /* NVML_CLOCK_SM */
    else if (type == 2) *clock = (unsigned int)mem;   /* NVML_CLOCK_MEM */
    else if (type == 0) *clock = (unsigned int)sm;    /* NVML_CLOCK_GRAPHICS */
    else return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPerformanceState(nvmlDevice_t device, int *pstate) {
    CHECK_DEVICE(device, "clocks", 0);
    if (!pstate) return NVML_ERROR_INVALID_ARGUMENT;
    *pstate = (int)fake_list_ll("FAKE_NVML_PSTATE", device->gpu, -1, 0);
    return NVML_SUCCESS;
}

/* Data-center GPUs are cooled by the chassis: NOT_SUPPORTED unless FAKE_NVML_FAN_PCT says. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetFanSpeed(nvmlDevice_t device, unsigned int *speed) {
    CHECK_DEVICE(device, "fan", 0);
    if (!speed) return NVML_ERROR_INVALID_ARGUMENT;
    long long pct = fake_list_ll("FAKE_NVML_FAN_PCT", device->gpu, -1, -1);
    if (pct < 0) return NVML_ERROR_NOT_SUPPORTED;
    *speed = (unsigned int)pct;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------- */
/* Health: ECC, remapped rows, retired pages, clocks event reasons           */
/* ------------------------------------------------------------------------- */

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, int *current, int *pending) {
    CHECK_DEVICE(device, "ecc", 0);
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    char buf[32];
    long long cur = 1, pend = 1; /* NVML_FEATURE_ENABLED */
    if (fake_list_str("FAKE_NVML_ECC_MODE", device->gpu, -1, buf, sizeof buf)) {
        if (sscanf(buf, "%lld/%lld", &cur, &pend) == 1) pend = cur;
    }
    *current = cur ? 1 : 0;
    *pending = pend ? 1 : 0;
    return NVML_SUCCESS;
}

/* errorType: 0 corrected, 1 uncorrected; counterType: 0 volatile, 1 aggregate. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType,
                                                     int counterType, unsigned long long *count) {
    CHECK_DEVICE(device, "ecc", 0);
    if (!count || errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    static const char *const knobs[2][2] = {
        {"FAKE_NVML_ECC_VOLATILE_CORRECTED", "FAKE_NVML_ECC_AGGREGATE_CORRECTED"},
        {"FAKE_NVML_ECC_VOLATILE_UNCORRECTED", "FAKE_NVML_ECC_AGGREGATE_UNCORRECTED"},
    };
    *count = (unsigned long long)fake_list_ll(knobs[errorType][counterType], device->gpu, -1, 0);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                                   unsigned int *uncRows, unsigned int *isPending,
                                                   unsigned int *failureOccurred) {
    CHECK_DEVICE(device, "remapped_rows", 0);
    if (!corrRows || !uncRows || !isPending || !failureOccurred) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int v[4] = {0, 0, 0, 0};
    char buf[128];
    if (fake_list_str("FAKE_NVML_REMAPPED_ROWS", device->gpu, -1, buf, sizeof buf)) {
        char *save = NULL;
        int k = 0;
        for (char *tok = strtok_r(buf, "/", &save); tok && k < 4; tok = strtok_r(NULL, "/", &save)) {
            long long x;
            if (fake_parse_ll(tok, &x) && x >= 0) v[k] = (unsigned int)x;
            k++;
        }
    }
    *corrRows = v[0];
    *uncRows = v[1];
    *isPending = v[2];
    *failureOccurred = v[3];
    return NVML_SUCCESS;
}

/* Retired pages: NOT_SUPPORTED (as on Hopper) unless FAKE_NVML_RETIRED_PAGES is set. */
static nvmlReturn_t retired_pages(nvmlDevice_t device, int cause, unsigned int *count,
                                  unsigned long long *addresses, unsigned long long *timestamps) {
    CHECK_DEVICE(device, "retired_pages", 0);
    char *knob = fake_get_dup("FAKE_NVML_RETIRED_PAGES");
    int set = knob != NULL;
    free(knob);
    if (!set) return NVML_ERROR_NOT_SUPPORTED;
    if (!count || cause < 0 || cause > 1) return NVML_ERROR_INVALID_ARGUMENT;
    /* All injected pages are double-bit (cause 1) retirements. */
    long long n = cause == 1 ? fake_list_ll("FAKE_NVML_RETIRED_PAGES", device->gpu, -1, 0) : 0;
    if (n < 0) n = 0;
    if (*count < (unsigned int)n) {
        *count = (unsigned int)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n > 0 && !addresses) return NVML_ERROR_INVALID_ARGUMENT;
    for (long long k = 0; k < n; k++) {
        addresses[k] = 0x1000ULL * (unsigned long long)k;
        if (timestamps) timestamps[k] = 0;
    }
    *count = (unsigned int)n;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, int cause,
                                                   unsigned int *pageCount,
                                                   unsigned long long *addresses) {
    return retired_pages(device, cause, pageCount, addresses, NULL);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, int cause,
                                                      unsigned int *pageCount,
                                                      unsigned long long *addresses,
                                                      unsigned long long *timestamps) {
    return retired_pages(device, cause, pageCount, addresses, timestamps);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                                unsigned long long *reasons) {
    CHECK_DEVICE(device, "clocks_event_reasons", 0);
    if (!reasons) return NVML_ERROR_INVALID_ARGUMENT;
    *reasons = (unsigned long long)fake_list_ll("FAKE_NVML_CLOCKS_EVENT_REASONS", device->gpu, -1, 0);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                                   unsigned long long *reasons) {
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode) {
    CHECK_DEVICE(device, "persistence", 0);
    if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = fake_list_ll("FAKE_NVML_PERSISTENCE", device->gpu, -1, 1) ? 1 : 0;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, int *mode) {
    CHECK_DEVICE(device, "compute_mode", 0);
    if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
    *mode = (int)fake_list_ll("FAKE_NVML_COMPUTE_MODE", device->gpu, -1, 0);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------- */
/* Inventory: firmware versions and the configuration an operator sets       */
/* ------------------------------------------------------------------------- */

/* An H200's answers; each a per-GPU knob so that one GPU can differ from its peers. */
static nvmlReturn_t inventory_text(nvmlDevice_t device, const char *knob, const char *def,
                                   char *out, unsigned int len) {
    CHECK_DEVICE(device, "firmware", 0);
    char buf[96];
    if (!fake_list_str(knob, device->gpu, -1, buf, sizeof buf)) snprintf(buf, sizeof buf, "%s", def);
    return copy_string(out, len, buf);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetVbiosVersion(nvmlDevice_t device, char *version,
                                                   unsigned int length) {
    return inventory_text(device, "FAKE_NVML_VBIOS", "96.00.9F.00.04", version, length);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetInforomImageVersion(nvmlDevice_t device, char *version,
                                                          unsigned int length) {
    return inventory_text(device, "FAKE_NVML_INFOROM", "G525.0230.00.01", version, length);
}

/* pynvml passes a 64-byte buffer (NVML_GSP_FIRMWARE_VERSION_BUF_SIZE) and no length. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGspFirmwareVersion(nvmlDevice_t device, char *version) {
    char def[64];
    char *driver = fake_get_dup("FAKE_NVML_DRIVER_VERSION");
    snprintf(def, sizeof def, "%s", driver && *driver ? driver : FAKE_DEFAULT_DRIVER_VERSION);
    free(driver);
    return inventory_text(device, "FAKE_NVML_GSP_FIRMWARE", def, version, 64);
}

/* The configured limit (nvidia-smi -pl); the enforced one is the same knob. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t device,
                                                           unsigned int *limit) {
    return nvmlDeviceGetEnforcedPowerLimit(device, limit);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetApplicationsClock(nvmlDevice_t device, int type,
                                                        unsigned int *clock) {
    CHECK_DEVICE(device, "clocks", 0);
    if (!clock) return NVML_ERROR_INVALID_ARGUMENT;
    char buf[64];
    long long sm = 1980, mem = 3201;
    if (fake_list_str("FAKE_NVML_APP_CLOCKS_MHZ", device->gpu, -1, buf, sizeof buf))
        sscanf(buf, "%lld/%lld", &sm, &mem);
    if (type == 0 || type == 1) *clock = (unsigned int)sm; /* GRAPHICS, SM */
    else if (type == 2) *clock = (unsigned int)mem;        /* MEM */
    else return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------- */
/* MIG                                                                       */
/* ------------------------------------------------------------------------- */

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current,
                                              unsigned int *pending) {
    CHECK_DEVICE(device, "mig", 0);
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = fake_mig_count(device->gpu) > 0 ? 1 : 0;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    CHECK_DEVICE(device, "mig", 0);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = FAKE_MAX_MIG;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                             nvmlDevice_t *migDevice) {
    CHECK_DEVICE(device, "mig", 0);
    if (!migDevice) return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= (unsigned int)fake_mig_count(device->gpu)) return NVML_ERROR_NOT_FOUND;
    *migDevice = &g_migs[device->gpu][index];
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMig) {
    CHECK_DEVICE(device, NULL, 1);
    if (!isMig) return NVML_ERROR_INVALID_ARGUMENT;
    *isMig = device->mig >= 0;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                                      nvmlDevice_t *device) {
    CHECK_DEVICE(migDevice, NULL, 1);
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    if (migDevice->mig < 0) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &g_gpus[migDevice->gpu];
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    CHECK_DEVICE(device, NULL, 1);
    if (!id) return NVML_ERROR_INVALID_ARGUMENT;
    if (device->mig < 0) return NVML_ERROR_NOT_SUPPORTED;
    *id = (unsigned int)device->mig;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    return nvmlDeviceGetGpuInstanceId(device, id);
}

/* ------------------------------------------------------------------------- */
/* Field values                                                              */
/* ------------------------------------------------------------------------- */

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                                  nvmlFieldValue_t *values) {
    CHECK_DEVICE(device, "field_values", 0);
    if (valuesCount < 0 || (valuesCount > 0 && !values)) return NVML_ERROR_INVALID_ARGUMENT;
    long long now = fake_now_us();
    for (int k = 0; k < valuesCount; k++) {
        nvmlFieldValue_t *v = &values[k];
        v->timestamp = now;
        v->latencyUsec = 0;
        memset(&v->value, 0, sizeof v->value);
        if (v->fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) {
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_INT;
            v->value.uiVal =
                (unsigned int)fake_list_ll("FAKE_NVML_RECOVERY_ACTION", device->gpu, -1, 0);
            v->nvmlReturn = NVML_SUCCESS;
        } else if (v->fieldId == NVML_FI_DEV_PCIE_COUNT_TX_BYTES &&
                   fake_list_ll("FAKE_NVML_LINK_KBPS", device->gpu, -1, -1) >= 0) {
            /* KB/s x s x 1000 = bytes: the counter grows at the scripted rate. */
            long long kbps = fake_list_ll("FAKE_NVML_LINK_KBPS", device->gpu, -1, 0);
            v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
            v->value.ullVal = (unsigned long long)((double)kbps * 1000.0 * ((double)now / 1e6));
            v->nvmlReturn = NVML_SUCCESS;
        } else {
            v->valueType = 0;
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------- */
/* Processes                                                                 */
/* ------------------------------------------------------------------------- */

/*
 * A full-GPU handle sees every process on that GPU (including those on its
 * MIG instances, tagged with their instance ids); a MIG handle sees its own.
 */
static nvmlReturn_t running_processes(const char *knob, nvmlDevice_t device,
                                      unsigned int *infoCount, nvmlProcessInfo_t *infos) {
    CHECK_DEVICE(device, "processes", 1);
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    char *list = fake_get_dup(knob);
    char *cur = list, *rest;
    int gpu, mig;
    unsigned int n = 0, cap = *infoCount;
    while (fake_list_next(&cur, &gpu, &mig, &rest)) {
        if (gpu != device->gpu) continue;
        if (device->mig >= 0 && mig != device->mig) continue;
        char *colon = strchr(rest, ':');
        long long pid, mib = 0;
        if (colon) {
            *colon = '\0';
            if (!fake_parse_ll(colon + 1, &mib)) mib = 0;
        }
        if (!fake_parse_ll(rest, &pid)) continue;
        if (infos && n < cap) {
            infos[n].pid = (unsigned int)pid;
            infos[n].usedGpuMemory = (unsigned long long)mib * FAKE_MIB;
            infos[n].gpuInstanceId = mig >= 0 ? (unsigned int)mig : NVML_VALUE_NOT_AVAILABLE_UINT;
            infos[n].computeInstanceId = mig >= 0 ? (unsigned int)mig : NVML_VALUE_NOT_AVAILABLE_UINT;
        }
        n++;
    }
    free(list);
    if (n > cap) {
        *infoCount = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n > 0 && !infos) return NVML_ERROR_INVALID_ARGUMENT;
    *infoCount = n;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                                 unsigned int *infoCount,
                                                                 nvmlProcessInfo_t *infos) {
    return running_processes("FAKE_NVML_PROCESSES", device, infoCount, infos);
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device,
                                                                  unsigned int *infoCount,
                                                                  nvmlProcessInfo_t *infos) {
    return running_processes("FAKE_NVML_GRAPHICS_PROCESSES", device, infoCount, infos);
}

/* ------------------------------------------------------------------------- */
/* PCIe link, NVLink, fabric, pending page retirement                        */
/* ------------------------------------------------------------------------- */

/* Field k (0 cur gen, 1 max gen, 2 cur width, 3 max width) of FAKE_NVML_PCIE for a GPU. */
static unsigned int pcie_field(int gpu, int k) {
    static const unsigned int defaults[4] = {5, 5, 16, 16};
    unsigned int v[4] = {defaults[0], defaults[1], defaults[2], defaults[3]};
    char buf[128];
    if (fake_list_str("FAKE_NVML_PCIE", gpu, -1, buf, sizeof buf)) {
        char *save = NULL;
        int n = 0;
        for (char *tok = strtok_r(buf, "/", &save); tok && n < 4; tok = strtok_r(NULL, "/", &save)) {
            long long x;
            if (fake_parse_ll(tok, &x) && x >= 0) v[n] = (unsigned int)x;
            n++;
        }
    }
    return v[k];
}

#define PCIE_GETTER(name, k)                                                 \
    FAKE_EXPORT nvmlReturn_t name(nvmlDevice_t device, unsigned int *out) { \
        CHECK_DEVICE(device, "pcie", 0);                                     \
        if (!out) return NVML_ERROR_INVALID_ARGUMENT;                        \
        *out = pcie_field(device->gpu, (k));                                 \
        return NVML_SUCCESS;                                                 \
    }
PCIE_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, 0)
PCIE_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, 1)
PCIE_GETTER(nvmlDeviceGetGpuMaxPcieLinkGeneration, 1)
PCIE_GETTER(nvmlDeviceGetCurrPcieLinkWidth, 2)
PCIE_GETTER(nvmlDeviceGetMaxPcieLinkWidth, 3)

/* True when `link` is listed for this GPU in FAKE_NVML_NVLINK_DOWN (L/L/...). */
static int nvlink_down(int gpu, unsigned int link) {
    char buf[256];
    if (!fake_list_str("FAKE_NVML_NVLINK_DOWN", gpu, -1, buf, sizeof buf)) return 0;
    char *save = NULL;
    for (char *tok = strtok_r(buf, "/", &save); tok; tok = strtok_r(NULL, "/", &save)) {
        long long x;
        if (fake_parse_ll(tok, &x) && x == (long long)link) return 1;
    }
    return 0;
}

/* As the real library: NOT_SUPPORTED without NVLink, INVALID_ARGUMENT past the last link. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link,
                                                  unsigned int *isActive) {
    CHECK_DEVICE(device, "nvlink", 0);
    if (!isActive) return NVML_ERROR_INVALID_ARGUMENT;
    long long links = fake_list_ll("FAKE_NVML_NVLINKS", device->gpu, -1, 0);
    if (links <= 0) return NVML_ERROR_NOT_SUPPORTED;
    if (link >= (unsigned int)links || link >= NVML_NVLINK_MAX_LINKS)
        return NVML_ERROR_INVALID_ARGUMENT;
    *isActive = nvlink_down(device->gpu, link) ? 0 : 1;
    return NVML_SUCCESS;
}

/* nvmlIntNvLinkDeviceType_t */
#define NVML_NVLINK_DEVICE_TYPE_GPU 0x00
#define NVML_NVLINK_DEVICE_TYPE_SWITCH 0x02
#define FAKE_NVSWITCHES 4

/* Where link `link` of `gpu` ends: a GPU index, or -1 for an NVSwitch (FAKE_NVML_NVLINK_PEERS). */
static int nvlink_peer(int gpu, unsigned int link) {
    char buf[256];
    if (!fake_list_str("FAKE_NVML_NVLINK_PEERS", gpu, -1, buf, sizeof buf)) return -1;
    int peers[NVML_NVLINK_MAX_LINKS], n = 0;
    char *save = NULL;
    for (char *tok = strtok_r(buf, "/", &save); tok && n < NVML_NVLINK_MAX_LINKS;
         tok = strtok_r(NULL, "/", &save)) {
        long long x;
        peers[n++] = fake_parse_ll(tok, &x) && x >= 0 ? (int)x : -1; /* `switch` */
    }
    return n ? peers[link % (unsigned int)n] : -1;
}

/* The remote-end calls' prologue: a link that exists and is active, remote calls supported. */
static nvmlReturn_t check_remote(nvmlDevice_t device, unsigned int link) {
    unsigned int active = 0;
    nvmlReturn_t rc = nvmlDeviceGetNvLinkState(device, link, &active);
    if (rc != NVML_SUCCESS) return rc;
    if (unsupported("nvlink_remote")) return NVML_ERROR_NOT_SUPPORTED;
    return active ? NVML_SUCCESS : NVML_ERROR_NOT_SUPPORTED;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device,
                                                             unsigned int link,
                                                             unsigned int *type) {
    nvmlReturn_t rc = check_remote(device, link);
    if (rc != NVML_SUCCESS) return rc;
    if (unsupported("nvlink_remote_type")) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (!type) return NVML_ERROR_INVALID_ARGUMENT;
    *type = nvlink_peer(device->gpu, link) >= 0 ? NVML_NVLINK_DEVICE_TYPE_GPU
                                                : NVML_NVLINK_DEVICE_TYPE_SWITCH;
    return NVML_SUCCESS;
}

/* The peer GPU's own PCI info, or an NVSwitch's (bus C0 + link mod 4). */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device,
                                                             unsigned int link,
                                                             nvmlPciInfo_t *pci) {
    nvmlReturn_t rc = check_remote(device, link);
    if (rc != NVML_SUCCESS) return rc;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    int peer = nvlink_peer(device->gpu, link);
    if (peer >= 0) return nvmlDeviceGetPciInfo_v3(&g_gpus[peer % FAKE_MAX_GPUS], pci);
    memset(pci, 0, sizeof *pci);
    unsigned int bus = 0xC0u + link % FAKE_NVSWITCHES;
    pci->bus = bus;
    pci->pciDeviceId = 0x22A310DEu; /* an NVSwitch of an HGX H100/H200 baseboard */
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", bus);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", bus);
    return NVML_SUCCESS;
}
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link,
                                                          nvmlPciInfo_t *pci) {
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci);
}

/* FAKE_NVML_FABRIC=IDX:STATE/STATUS; returns 0 (NOT_SUPPORTED) when unset for this GPU. */
static int fabric_of(int gpu, unsigned int *state, nvmlReturn_t *status) {
    char buf[64];
    if (!fake_list_str("FAKE_NVML_FABRIC", gpu, -1, buf, sizeof buf)) return 0;
    long long st = 0, rc = 0;
    char *slash = strchr(buf, '/');
    if (slash) {
        *slash = '\0';
        if (!fake_parse_ll(slash + 1, &rc)) rc = 0;
    }
    if (!fake_parse_ll(buf, &st)) st = 0;
    *state = (unsigned int)st;
    *status = (nvmlReturn_t)rc;
    return 1;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device,
                                                    nvmlGpuFabricInfo_t *info) {
    CHECK_DEVICE(device, "fabric", 0);
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    memset(info, 0, sizeof *info);
    if (!fabric_of(device->gpu, &info->state, &info->status)) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device,
                                                     nvmlGpuFabricInfo_v2_t *info) {
    CHECK_DEVICE(device, "fabric", 0);
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != NVML_GPU_FABRIC_INFO_V2_VERSION) return 25; /* ARGUMENT_VERSION_MISMATCH */
    memset(info->clusterUuid, 0, sizeof info->clusterUuid);
    info->cliqueId = 0;
    info->healthMask = 0;
    if (!fabric_of(device->gpu, &info->state, &info->status)) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

/* Like the retired-page list: NOT_SUPPORTED (Hopper) unless a retired-pages knob is set. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device,
                                                                int *isPending) {
    CHECK_DEVICE(device, "retired_pages", 0);
    if (!isPending) return NVML_ERROR_INVALID_ARGUMENT;
    char *a = fake_get_dup("FAKE_NVML_RETIRED_PAGES");
    char *b = fake_get_dup("FAKE_NVML_RETIRED_PAGES_PENDING");
    int set = a != NULL || b != NULL;
    free(a);
    free(b);
    if (!set) return NVML_ERROR_NOT_SUPPORTED;
    *isPending = fake_list_ll("FAKE_NVML_RETIRED_PAGES_PENDING", device->gpu, -1, 0) ? 1 : 0;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------- */
/* Events (XIDs)                                                             */
/* ------------------------------------------------------------------------- */

#define FAKE_MAX_XIDS 4096

typedef struct {
    unsigned long long types[FAKE_MAX_GPUS]; /* registered event types per GPU */
} fake_event_set;
typedef fake_event_set *nvmlEventSet_t;

static pthread_mutex_t g_event_lock = PTHREAD_MUTEX_INITIALIZER;
/* What this process delivered so far, by content (GPU, MIG instance, XID) with a count:
 * FAKE_NVML_XIDS is a multiset, and what it holds beyond what was delivered is pending.
 * Rewriting the state file with a new XID delivers it; one already delivered is delivered
 * again only when listed once more (3:79,3:79 after 3:79). */
typedef struct { int gpu, mig; long long xid; int count; } fake_xid_seen;
static fake_xid_seen g_xid_seen[FAKE_MAX_XIDS];
static int g_xid_seen_n;

static fake_xid_seen *xid_seen(int gpu, int mig, long long xid, int add) {
    for (int i = 0; i < g_xid_seen_n; i++)
        if (g_xid_seen[i].gpu == gpu && g_xid_seen[i].mig == mig && g_xid_seen[i].xid == xid)
            return &g_xid_seen[i];
    if (!add || g_xid_seen_n >= FAKE_MAX_XIDS) return NULL;
    g_xid_seen[g_xid_seen_n] = (fake_xid_seen){gpu, mig, xid, 0};
    return &g_xid_seen[g_xid_seen_n++];
}

FAKE_EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    CHECK_INIT();
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof **set);
    return *set ? NVML_SUCCESS : 20; /* NVML_ERROR_MEMORY */
}

FAKE_EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    CHECK_INIT();
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    free(set);
    return NVML_SUCCESS;
}

FAKE_EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                          unsigned long long *types) {
    CHECK_DEVICE(device, "events", 0);
    if (!types) return NVML_ERROR_INVALID_ARGUMENT;
    *types = FAKE_SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

/* Like the real driver, asking for an unsupported type fails the registration. */
FAKE_EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types,
                                                  nvmlEventSet_t set) {
    CHECK_DEVICE(device, "events", 0);
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~FAKE_SUPPORTED_EVENTS) return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&g_event_lock);
    set->types[device->gpu] |= types;
    pthread_mutex_unlock(&g_event_lock);
    return NVML_SUCCESS;
}

/* Delivers the first pending XID this set listens for; 1 if one was found. The k-th listing
 * of an entry is pending while fewer than k of that entry were delivered. */
static int take_pending_xid(nvmlEventSet_t set, nvmlEventData_t *data) {
    char *list = fake_get_dup("FAKE_NVML_XIDS");
    char *cur = list, *rest;
    int gpu, mig, k = 0, found = 0;
    static int gpus[FAKE_MAX_XIDS], migs[FAKE_MAX_XIDS];
    static long long xids[FAKE_MAX_XIDS];
    pthread_mutex_lock(&g_event_lock);
    while (!found && k < FAKE_MAX_XIDS && fake_list_next(&cur, &gpu, &mig, &rest)) {
        long long xid;
        if (!fake_parse_ll(rest, &xid)) continue;
        int listed = 1; /* this entry's listing number */
        for (int i = 0; i < k; i++)
            if (gpus[i] == gpu && migs[i] == mig && xids[i] == xid) listed++;
        gpus[k] = gpu; migs[k] = mig; xids[k] = xid; k++;
        fake_xid_seen *seen = xid_seen(gpu, mig, xid, 0);
        if (seen && seen->count >= listed) continue;
        if (gpu >= FAKE_MAX_GPUS || !(set->types[gpu] & nvmlEventTypeXidCriticalError)) continue;
        seen = xid_seen(gpu, mig, xid, 1);
        if (!seen) continue;
        seen->count++;
        data->device = &g_gpus[gpu];
        data->eventType = nvmlEventTypeXidCriticalError;
        data->eventData = (unsigned long long)xid;
        data->gpuInstanceId = mig >= 0 ? (unsigned int)mig : NVML_VALUE_NOT_AVAILABLE_UINT;
        data->computeInstanceId = mig >= 0 ? (unsigned int)mig : NVML_VALUE_NOT_AVAILABLE_UINT;
        found = 1;
    }
    pthread_mutex_unlock(&g_event_lock);
    free(list);
    return found;
}

#define FAKE_MAX_STORM 64
static long long g_storm_done[FAKE_MAX_STORM]; /* events delivered per storm entry */
static long long g_storm_total, g_storm_started_ms;
static int g_storm_next; /* the entry whose turn it is */

/* Delivers the next storm event (FAKE_NVML_XID_STORM); 1 if one was delivered, 0 when the
 * storm is over or none is due yet (*due_ms then says when, at FAKE_NVML_XID_STORM_RATE). */
static int take_storm_xid(nvmlEventSet_t set, nvmlEventData_t *data, long long *due_ms) {
    char *list = fake_get_dup("FAKE_NVML_XID_STORM");
    if (!list) return 0;
    int gpus[FAKE_MAX_STORM];
    long long xids[FAKE_MAX_STORM], counts[FAKE_MAX_STORM];
    int n = 0, gpu, mig, found = 0;
    char *cur = list, *rest;
    while (n < FAKE_MAX_STORM && fake_list_next(&cur, &gpu, &mig, &rest)) {
        char *star = strchr(rest, '*');
        if (!star) continue;
        *star = '\0';
        if (!fake_parse_ll(rest, &xids[n]) || !fake_parse_ll(star + 1, &counts[n])) continue;
        gpus[n++] = gpu;
    }
    free(list);
    long long rate = fake_get_ll("FAKE_NVML_XID_STORM_RATE", 0);
    pthread_mutex_lock(&g_event_lock);
    long long now = fake_monotonic_ms();
    if (g_storm_total == 0) g_storm_started_ms = now;
    if (rate > 0 && g_storm_started_ms + g_storm_total * 1000 / rate > now) {
        *due_ms = g_storm_started_ms + g_storm_total * 1000 / rate;
    } else {
        for (int tried = 0; tried < n && !found; tried++) {
            int i = (g_storm_next + tried) % n;
            if (g_storm_done[i] >= counts[i] || gpus[i] >= FAKE_MAX_GPUS ||
                !(set->types[gpus[i]] & nvmlEventTypeXidCriticalError))
                continue;
            g_storm_done[i]++;
            g_storm_total++;
            g_storm_next = (i + 1) % n;
            data->device = &g_gpus[gpus[i]];
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = (unsigned long long)xids[i];
            data->gpuInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
            data->computeInstanceId = NVML_VALUE_NOT_AVAILABLE_UINT;
            found = 1;
        }
    }
    pthread_mutex_unlock(&g_event_lock);
    return found;
}

FAKE_EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                             unsigned int timeoutms) {
    CHECK_INIT();
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    long long deadline = fake_monotonic_ms() + timeoutms;
    for (;;) {
        long long due = deadline;
        if (take_pending_xid(set, data) || take_storm_xid(set, data, &due))
            return NVML_SUCCESS;
        long long now = fake_monotonic_ms(), left = deadline - now;
        if (left <= 0) return NVML_ERROR_TIMEOUT;
        /* A storm paced by its rate wakes when its next event is due (at most 1 ms early). */
        long long nap = due < deadline ? due - now : left;
        fake_sleep_ms(nap < 1 ? 1 : nap < 50 ? (long)nap : 50);
    }
}

FAKE_EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data,
                                          unsigned int timeoutms) {
    return nvmlEventSetWait_v2(set, data, timeoutms);
}
