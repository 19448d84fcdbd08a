/*
 * fake_cuda.c - a fake CUDA driver (libcuda.so.1, plus a libcuda.so symlink)
 * for gpudiag's tests.
 *
 * Build: gcc -std=c11 -shared -fPIC -fvisibility=hidden
 *            -Wl,-soname,libcuda.so.1 -o libcuda.so.1 fake_cuda.c -lpthread
 *
 * It implements enough of the CUDA driver API for ctypes probes and for IREE's
 * CUDA HAL (which dlopens "libcuda.so" and resolves every entry point through
 * cuGetProcAddress) to enumerate devices, create a device, allocate memory
 * and copy to and from it.  "Device" memory is host memory, so copies, memsets
 * and memcpy/memset graph nodes really move bytes.  Kernels are accepted and
 * launched as no-ops: their outputs are never written.
 *
 * The real jax-cuda12 plugin and XLA (which dlsym the driver's entry points)
 * get through cuInit, device enumeration (VMM support included) and primary
 * context creation, so faults there reach real XLA.  The CUDA runtime (cudart)
 * then asks cuGetExportTable for the driver's private tables, which the fake
 * does not have: a healthy fake ends there with cudaErrorSymbolNotFound.
 *
 * Knobs (environment, overridden by FAKE_GPU_STATE_FILE; see fake_common.h):
 *   FAKE_CUDA_DEVICE_COUNT     physical GPUs (default FAKE_NVML_DEVICE_COUNT, else 8)
 *   CUDA_VISIBLE_DEVICES       honoured like the real driver (environment only)
 *   FAKE_CUDA_INIT_ERROR=<n>   cuInit returns this CUresult
 *   FAKE_CUDA_INIT_HANG=1      cuInit never returns
 *   FAKE_CUDA_INIT_CRASH=1     cuInit raises SIGSEGV
 *   FAKE_CUDA_CTX_ERROR=<n>    context creation / primary context retain fail
 *   FAKE_CUDA_ALLOC_ERROR=<n>  device allocations fail
 *   FAKE_CUDA_LAUNCH_ERROR=<n> kernel launches (and graphs with kernels) fail
 *   FAKE_CUDA_DRIVER_VERSION   cuDriverGetVersion (default 12080)
 *   FAKE_CUDA_VMM=0            device attribute 102 (virtual memory management) reads 0,
 *                              as on some virtualized GPUs; XLA then refuses the device
 *   FAKE_CUDA_TRACE=1          log every call (and cuGetProcAddress look-ups) to stderr
 *   FAKE_CUDA_COPY_GBPS=IDX:GBPS, FAKE_CUDA_CORRUPT_COPY=IDX:OFFSET
 *                              copy speed and a wrong byte per GPU (see copy_faults)
 *   FAKE_CUDA_MEMORY_FAULT=IDX:OFFSET:BIT[:MODE]
 *                              one bad cell in GPU IDX's memory: bit BIT of byte OFFSET of
 *                              every allocation (mod its size) reads back flipped (MODE
 *                              flip, the default), as 0 (stuck0) or as 1 (stuck1), in every
 *                              device-to-host copy that covers it (see memory_fault)
 *   FAKE_CUDA_WORK_SETS=IDX:KEY=VALUE
 *                              a diagnostic that changes its GPU (diagnostic_side_effect):
 *                              the first device-to-device copy of a process on physical GPU
 *                              IDX (the work qualification does; the cuda probe only
 *                              allocates) writes KEY=VALUE into FAKE_GPU_STATE_FILE
 *                              (replacing the file atomically), as if the work had changed
 *                              a setting the fake NVML then reports
 *                              (e.g. FAKE_NVML_APP_CLOCKS_MHZ=4:1755/3201)
 *   FAKE_GPU_NAME, FAKE_GPU_MEMORY_TOTAL_MIB, FAKE_NVML_MIG,
 *   FAKE_NVML_MEMORY_USED_MIB  shared with the fake NVML
 *
 * Busy GPUs:
 *   FAKE_CUDA_CONTEXT_MIB=<n>  device memory a new context needs (default 500)
 *   FAKE_CUDA_CONTEXT_LOG=PATH append one JSON line per context creation attempt,
 *                              per device allocation and per synchronous HtoD, DtoH or
 *                              DtoD copy (see log_device_event)
 * Contexts follow the GPU's state as the fake NVML reports it (fake_common.h):
 * creating one (cuCtxCreate*, or the first cuDevicePrimaryCtxRetain of a device
 * in this process) fails with
 *   - FAKE_CUDA_CTX_ERROR when set (checked first, on every retain too);
 *   - CUDA_ERROR_DEVICE_UNAVAILABLE (46) when the physical GPU's
 *     FAKE_NVML_COMPUTE_MODE is PROHIBITED (2), or EXCLUSIVE_PROCESS (3) or
 *     EXCLUSIVE_THREAD (1) while FAKE_NVML_PROCESSES lists a PID other than the
 *     calling process on that GPU (on that MIG instance, for a MIG device);
 *   - CUDA_ERROR_OUT_OF_MEMORY (2) when the device's total memory, less
 *     FAKE_NVML_MEMORY_USED_MIB and this process's own allocations, is below
 *     FAKE_CUDA_CONTEXT_MIB.  A context's memory is not charged afterwards.
 * Contexts made through the fake are invisible to other processes: only the
 * processes listed in FAKE_NVML_PROCESSES make a GPU busy (tests/fakes/jobs.py
 * lists real ones).
 * Device ordinals map to physical GPUs through CUDA_VISIBLE_DEVICES (indices,
 * unique GPU UUID prefixes, MIG UUIDs), and these checks and the log use the
 * physical GPU.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <unistd.h>

#include "fake_common.h"

/* ------------------------------------------------------------------------- */
/* Types from cuda.h                                                         */
/* ------------------------------------------------------------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long cuuint64_t;
typedef struct fake_ctx *CUcontext;
typedef struct fake_stream *CUstream;
typedef struct fake_event *CUevent;
typedef struct fake_module *CUmodule;
typedef struct fake_function *CUfunction;
typedef struct fake_graph *CUgraph;
typedef struct fake_graph_node *CUgraphNode;
typedef struct fake_graph_exec *CUgraphExec;
typedef struct fake_mempool *CUmemoryPool;
typedef void (*CUhostFn)(void *userData);
typedef struct {
    char bytes[16];
} CUuuid;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
};

/* cuda.h CUDA_MEMCPY3D (64-bit layout). */
typedef struct {
    size_t srcXInBytes, srcY, srcZ, srcLOD;
    int srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    void *reserved0;
    size_t srcPitch, srcHeight;
    size_t dstXInBytes, dstY, dstZ, dstLOD;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    void *reserved1;
    size_t dstPitch, dstHeight;
    size_t WidthInBytes, Height, Depth;
} CUDA_MEMCPY3D;
_Static_assert(sizeof(CUDA_MEMCPY3D) == 200, "CUDA_MEMCPY3D layout");

#define CU_MEMORYTYPE_HOST 1

/* cuda.h CUDA_MEMSET_NODE_PARAMS. */
typedef struct {
    CUdeviceptr dst;
    size_t pitch;
    unsigned int value;
    unsigned int elementSize;
    size_t width;
    size_t height;
} CUDA_MEMSET_NODE_PARAMS;

/* ------------------------------------------------------------------------- */
/* Tracing and error strings                                                 */
/* ------------------------------------------------------------------------- */

static void trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void trace(const char *fmt, ...) {
    if (!fake_get_flag("FAKE_CUDA_TRACE")) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "fake-cuda: %s\n", line);
}

#define TRACE_CALL() trace("%s", __func__)

typedef struct {
    int code;
    const char *name;
    const char *text;
} cu_error_info;

/* Names and strings as the real driver's cuGetErrorName / cuGetErrorString give them: every
 * code NVIDIA's 535 libcuda names, checked against it by tests/test_real_nvidia.py. */
static const cu_error_info g_errors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {5, "CUDA_ERROR_PROFILER_DISABLED", "profiler disabled while using external profiling tool"},
    {6, "CUDA_ERROR_PROFILER_NOT_INITIALIZED", "profiler not initialized: call cudaProfilerInitialize()"},
    {7, "CUDA_ERROR_PROFILER_ALREADY_STARTED", "profiler already started"},
    {8, "CUDA_ERROR_PROFILER_ALREADY_STOPPED", "profiler already stopped"},
    {34, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {46, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {102, "CUDA_ERROR_DEVICE_NOT_LICENSED", "device doesn't have valid Grid license"},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {202, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT", "context already current"},
    {205, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {206, "CUDA_ERROR_UNMAP_FAILED", "unmapping of buffer object failed"},
    {207, "CUDA_ERROR_ARRAY_IS_MAPPED", "array is mapped"},
    {208, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {209, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {210, "CUDA_ERROR_ALREADY_ACQUIRED", "resource already acquired"},
    {211, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {212, "CUDA_ERROR_NOT_MAPPED_AS_ARRAY", "resource not mapped as array"},
    {213, "CUDA_ERROR_NOT_MAPPED_AS_POINTER", "resource not mapped as pointer"},
    {214, "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"},
    {215, "CUDA_ERROR_UNSUPPORTED_LIMIT", "limit is not supported on this architecture"},
    {216, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE", "exclusive-thread device already in use by a different thread"},
    {217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices"},
    {218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {219, "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT", "invalid OpenGL or DirectX context"},
    {220, "CUDA_ERROR_NVLINK_UNCORRECTABLE", "uncorrectable NVLink error detected during the execution"},
    {221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND", "PTX JIT compiler library not found"},
    {222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain."},
    {223, "CUDA_ERROR_JIT_COMPILATION_DISABLED", "PTX JIT compilation was disabled"},
    {224, "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY", "the provided execution affinity is not supported"},
    {225, "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC", "the provided PTX contains unsupported call to cudaDeviceSynchronize"},
    {300, "CUDA_ERROR_INVALID_SOURCE", "device kernel image is invalid"},
    {301, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {302, "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND", "shared object symbol not found"},
    {303, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED", "shared object initialization failed"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {702, "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"},
    {703, "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING", "launch uses incompatible texturing mode"},
    {704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
    {705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
    {708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "cannot set while device is active in this process"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {710, "CUDA_ERROR_ASSERT", "device-side assert triggered"},
    {711, "CUDA_ERROR_TOO_MANY_PEERS", "peer mapping resources exhausted"},
    {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
    {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
    {714, "CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"},
    {715, "CUDA_ERROR_ILLEGAL_INSTRUCTION", "an illegal instruction was encountered"},
    {716, "CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"},
    {717, "CUDA_ERROR_INVALID_ADDRESS_SPACE", "operation not supported on global/shared address space"},
    {718, "CUDA_ERROR_INVALID_PC", "invalid program counter"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", "too many blocks in cooperative launch"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {802, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"},
    {803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"},
    {804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", "forward compatibility was attempted on non supported HW"},
    {805, "CUDA_ERROR_MPS_CONNECTION_FAILED", "MPS client failed to connect to the MPS control daemon or the MPS server"},
    {806, "CUDA_ERROR_MPS_RPC_FAILURE", "the remote procedural call between the MPS server and the MPS client failed"},
    {807, "CUDA_ERROR_MPS_SERVER_NOT_READY", "MPS server is not ready to accept new MPS client requests"},
    {808, "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED", "the hardware resources required to create MPS client have been exhausted"},
    {809, "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED", "the hardware resources required to support device connections have been exhausted"},
    {810, "CUDA_ERROR_MPS_CLIENT_TERMINATED", "the MPS client has been terminated by the server"},
    {811, "CUDA_ERROR_CDP_NOT_SUPPORTED", "is using CUDA Dynamic Parallelism, but the current configuration, like MPS, does not support it"},
    {812, "CUDA_ERROR_CDP_VERSION_MISMATCH", "unsupported interaction between different versions of CUDA Dynamic Parallelism"},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {902, "CUDA_ERROR_STREAM_CAPTURE_MERGE", "operation would result in a merge of separate capture sequences"},
    {903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "capture was not ended in the same stream as it began"},
    {904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "capturing stream has unjoined work"},
    {905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "dependency created on uncaptured work in another stream"},
    {906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "operation would make the legacy stream depend on a capturing blocking stream"},
    {907, "CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream"},
    {908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local capture sequence from another thread"},
    {909, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {910, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update"},
    {911, "CUDA_ERROR_EXTERNAL_DEVICE", "an async error has occured in external entity outside of CUDA"},
    {912, "CUDA_ERROR_INVALID_CLUSTER_SIZE", "a kernel launch error has occurred due to cluster misconfiguration"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static const cu_error_info *find_error(CUresult code) {
    for (size_t i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++)
        if (g_errors[i].code == code) return &g_errors[i];
    return NULL;
}

/* Unknown codes: *pStr = NULL and CUDA_ERROR_INVALID_VALUE, as documented. */
FAKE_EXPORT CUresult cuGetErrorName(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const cu_error_info *e = find_error(error);
    *pStr = e ? e->name : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const cu_error_info *e = find_error(error);
    *pStr = e ? e->text : NULL;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* ------------------------------------------------------------------------- */
/* Initialisation and the visible device list                                */
/* ------------------------------------------------------------------------- */

#define MAX_VISIBLE (FAKE_MAX_GPUS * (1 + FAKE_MAX_MIG))

typedef struct {
    int gpu; /* physical GPU index */
    int mig; /* MIG instance, -1 for the whole GPU */
} visible_device;

static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int g_initialized;
static visible_device g_visible[MAX_VISIBLE];
static int g_nvisible;

static int physical_gpu_count(void) {
    long long n = fake_get_ll("FAKE_CUDA_DEVICE_COUNT",
                              fake_get_ll("FAKE_NVML_DEVICE_COUNT", FAKE_DEFAULT_GPU_COUNT));
    if (n < 0) n = 0;
    if (n > FAKE_MAX_GPUS) n = FAKE_MAX_GPUS;
    return (int)n;
}

/* Hex digits of a UUID without dashes, lower case ("f00d0001..."). */
static void uuid_hex(const char *uuid_after_prefix, char *out, size_t len) {
    size_t k = 0;
    for (const char *p = uuid_after_prefix; *p && k + 1 < len; p++)
        if (*p != '-') out[k++] = (char)tolower((unsigned char)*p);
    out[k] = '\0';
}

/* Resolves one CUDA_VISIBLE_DEVICES entry; returns 0 if it names no device. */
static int resolve_visible_entry(const char *tok, int ngpu, visible_device *out) {
    char want[64], have[64], buf[96];
    if (strncasecmp(tok, "GPU-", 4) == 0) {
        /* A unique prefix of a GPU UUID, dashes optional. */
        uuid_hex(tok + 4, want, sizeof want);
        if (!*want) return 0;
        int match = -1;
        for (int i = 0; i < ngpu; i++) {
            fake_gpu_uuid(i, buf, sizeof buf);
            uuid_hex(buf + 4, have, sizeof have);
            if (strncmp(have, want, strlen(want)) == 0) {
                if (match >= 0) return 0; /* ambiguous */
                match = i;
            }
        }
        if (match < 0) return 0;
        out->gpu = match;
        out->mig = -1;
        return 1;
    }
    if (strncasecmp(tok, "MIG-", 4) == 0) {
        for (int i = 0; i < ngpu; i++) {
            for (int j = 0; j < fake_mig_count(i); j++) {
                fake_mig_uuid(i, j, buf, sizeof buf);
                if (strcasecmp(buf, tok) == 0) {
                    out->gpu = i;
                    out->mig = j;
                    return 1;
                }
            }
        }
        return 0;
    }
    /* A plain decimal ordinal. */
    char *end = NULL;
    errno = 0;
    long v = strtol(tok, &end, 10);
    if (end == tok || *end || errno || v < 0 || v >= ngpu) return 0;
    out->gpu = (int)v;
    out->mig = -1;
    return 1;
}

/*
 * Builds the visible device list.  Like the real driver, parsing stops at the
 * first entry that is invalid, names no device or repeats one; an empty value,
 * "-1" or "NoDevFiles" leaves no device at all.
 */
static void build_visible_list(void) {
    int ngpu = physical_gpu_count();
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    g_nvisible = 0;
    if (!cvd) {
        for (int i = 0; i < ngpu; i++) g_visible[g_nvisible++] = (visible_device){i, -1};
        return;
    }
    char *copy = strdup(cvd);
    char *save = NULL;
    for (char *tok = copy ? strtok_r(copy, ",", &save) : NULL; tok; tok = strtok_r(NULL, ",", &save)) {
        char *t = fake_strip(tok);
        visible_device d;
        if (strcasecmp(t, "NoDevFiles") == 0 || !resolve_visible_entry(t, ngpu, &d)) break;
        int dup = 0;
        for (int k = 0; k < g_nvisible; k++)
            dup |= g_visible[k].gpu == d.gpu && g_visible[k].mig == d.mig;
        if (dup || g_nvisible >= MAX_VISIBLE) break;
        g_visible[g_nvisible++] = d;
    }
    free(copy);
}

FAKE_EXPORT CUresult cuInit(unsigned int flags) {
    TRACE_CALL();
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (atomic_load(&g_initialized)) return CUDA_SUCCESS;
    if (fake_get_flag("FAKE_CUDA_INIT_HANG")) fake_hang_forever();
    if (fake_get_flag("FAKE_CUDA_INIT_CRASH")) raise(SIGSEGV);
    CUresult err = (CUresult)fake_get_ll("FAKE_CUDA_INIT_ERROR", 0);
    if (err != CUDA_SUCCESS) return err;
    pthread_mutex_lock(&g_init_lock);
    if (!atomic_load(&g_initialized)) build_visible_list();
    CUresult rc = g_nvisible > 0 ? CUDA_SUCCESS : CUDA_ERROR_NO_DEVICE;
    if (rc == CUDA_SUCCESS) atomic_store(&g_initialized, 1);
    pthread_mutex_unlock(&g_init_lock);
    return rc;
}

FAKE_EXPORT CUresult cuDriverGetVersion(int *version) {
    TRACE_CALL();
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = (int)fake_get_ll("FAKE_CUDA_DRIVER_VERSION", FAKE_DEFAULT_CUDA_VERSION);
    return CUDA_SUCCESS;
}

#define CHECK_INIT()                                                          \
    do {                                                                      \
        if (!atomic_load(&g_initialized)) return CUDA_ERROR_NOT_INITIALIZED; \
    } while (0)

#define CHECK_DEVICE(dev)                                                     \
    do {                                                                      \
        CHECK_INIT();                                                         \
        if ((dev) < 0 || (dev) >= g_nvisible) return CUDA_ERROR_INVALID_DEVICE; \
    } while (0)

/* ------------------------------------------------------------------------- */
/* Device queries                                                            */
/* ------------------------------------------------------------------------- */

static unsigned long long device_total_bytes(CUdevice dev) {
    const visible_device *v = &g_visible[dev];
    unsigned long long mib = v->mig >= 0 ? fake_mig_memory_total_mib(v->gpu) : fake_gpu_memory_total_mib();
    return mib * FAKE_MIB;
}

/* SMs: 132 for a whole H200, a share of them for a MIG slice. */
static int device_sm_count(CUdevice dev) {
    const visible_device *v = &g_visible[dev];
    if (v->mig < 0) return 132;
    int n = fake_mig_count(v->gpu);
    int slices = n > 0 ? FAKE_MAX_MIG / n : 1;
    return 16 * (slices < 1 ? 1 : slices);
}

FAKE_EXPORT CUresult cuDeviceGetCount(int *count) {
    TRACE_CALL();
    CHECK_INIT();
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = g_nvisible;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    TRACE_CALL();
    CHECK_INIT();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= g_nvisible) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    char buf[128];
    if (g_visible[dev].mig >= 0)
        fake_mig_name(g_visible[dev].gpu, buf, sizeof buf);
    else
        fake_gpu_name(buf, sizeof buf);
    snprintf(name, (size_t)len, "%s", buf); /* the real driver truncates too */
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    unsigned char bytes[16];
    if (g_visible[dev].mig >= 0)
        fake_mig_uuid_bytes(g_visible[dev].gpu, g_visible[dev].mig, bytes);
    else
        fake_gpu_uuid_bytes(g_visible[dev].gpu, bytes);
    memcpy(uuid->bytes, bytes, 16);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) { return cuDeviceGetUuid_v2(uuid, dev); }

FAKE_EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = (size_t)device_total_bytes(dev);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    if (!pi || attrib <= 0 || attrib > 200) return CUDA_ERROR_INVALID_VALUE;
    int v;
    switch (attrib) {
    case 1: v = 1024; break;          /* MAX_THREADS_PER_BLOCK */
    case 2: case 3: v = 1024; break;  /* MAX_BLOCK_DIM_X / Y */
    case 4: v = 64; break;            /* MAX_BLOCK_DIM_Z */
    case 5: v = 2147483647; break;    /* MAX_GRID_DIM_X */
    case 6: case 7: v = 65535; break; /* MAX_GRID_DIM_Y / Z */
    case 8: v = 49152; break;         /* MAX_SHARED_MEMORY_PER_BLOCK */
    case 9: v = 65536; break;         /* TOTAL_CONSTANT_MEMORY */
    case 10: v = 32; break;           /* WARP_SIZE */
    case 11: v = 2147483647; break;   /* MAX_PITCH */
    case 12: v = 65536; break;        /* MAX_REGISTERS_PER_BLOCK */
    case 13: v = 1980000; break;      /* CLOCK_RATE (kHz) */
    case 14: v = 512; break;          /* TEXTURE_ALIGNMENT */
    case 15: v = 1; break;            /* GPU_OVERLAP */
    case 16: v = device_sm_count(dev); break; /* MULTIPROCESSOR_COUNT */
    case 19: v = 1; break;            /* CAN_MAP_HOST_MEMORY */
    case 31: v = 1; break;            /* CONCURRENT_KERNELS */
    case 32: v = 1; break;            /* ECC_ENABLED */
    case 33: v = fake_pci_bus(g_visible[dev].gpu); break; /* PCI_BUS_ID */
    case 36: v = 3201000; break;      /* MEMORY_CLOCK_RATE (kHz) */
    case 37: v = 6144; break;         /* GLOBAL_MEMORY_BUS_WIDTH */
    case 38: v = 62914560; break;     /* L2_CACHE_SIZE */
    case 39: v = 2048; break;         /* MAX_THREADS_PER_MULTIPROCESSOR */
    case 40: v = 3; break;            /* ASYNC_ENGINE_COUNT */
    case 41: v = 1; break;            /* UNIFIED_ADDRESSING */
    case 75: v = 9; break;            /* COMPUTE_CAPABILITY_MAJOR */
    case 76: v = 0; break;            /* COMPUTE_CAPABILITY_MINOR */
    case 81: v = 233472; break;       /* MAX_SHARED_MEMORY_PER_MULTIPROCESSOR */
    case 82: v = 65536; break;        /* MAX_REGISTERS_PER_MULTIPROCESSOR */
    case 83: v = 1; break;            /* MANAGED_MEMORY */
    case 89: v = 1; break;            /* CONCURRENT_MANAGED_ACCESS */
    case 97: v = 232448; break;       /* MAX_SHARED_MEMORY_PER_BLOCK_OPTIN */
    case 102: v = fake_get_ll("FAKE_CUDA_VMM", 1) != 0; break; /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    case 106: v = 32; break;          /* MAX_BLOCKS_PER_MULTIPROCESSOR */
    case 115: v = 1; break;           /* MEMORY_POOLS_SUPPORTED */
    default: v = 0; break;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceComputeCapability(int *major, int *minor, CUdevice dev) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    if (!major || !minor) return CUDA_ERROR_INVALID_VALUE;
    *major = 9;
    *minor = 0;
    return CUDA_SUCCESS;
}

/* "0000:18:00.0", the format the real driver uses. */
FAKE_EXPORT CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    if (!pciBusId || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(pciBusId, (size_t)len, "0000:%02x:00.0", fake_pci_bus(g_visible[dev].gpu));
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetByPCIBusId(CUdevice *dev, const char *pciBusId) {
    TRACE_CALL();
    CHECK_INIT();
    if (!dev || !pciBusId) return CUDA_ERROR_INVALID_VALUE;
    unsigned int domain = 0, bus = 0, device = 0, function = 0;
    if (sscanf(pciBusId, "%x:%x:%x.%x", &domain, &bus, &device, &function) != 4)
        return CUDA_ERROR_INVALID_VALUE;
    for (int k = 0; k < g_nvisible; k++) {
        if (domain == 0 && (int)bus == fake_pci_bus(g_visible[k].gpu) && device == 0) {
            *dev = k;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

FAKE_EXPORT CUresult cuDeviceCanAccessPeer(int *canAccess, CUdevice dev, CUdevice peer) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    CHECK_DEVICE(peer);
    if (!canAccess) return CUDA_ERROR_INVALID_VALUE;
    *canAccess = dev != peer;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------- */
/* Contexts                                                                  */
/* ------------------------------------------------------------------------- */

#define CTX_MAGIC 0xC0C7C0C7u

struct fake_ctx {
    unsigned magic;
    CUdevice dev;
    int primary;
};

static struct fake_ctx g_primary[MAX_VISIBLE];
static int g_primary_refs[MAX_VISIBLE];
static unsigned g_primary_flags[MAX_VISIBLE];
static pthread_mutex_t g_ctx_lock = PTHREAD_MUTEX_INITIALIZER;

/* Per-thread context stack, as in the real driver. */
#define CTX_STACK_MAX 64
static _Thread_local CUcontext t_ctx_stack[CTX_STACK_MAX];
static _Thread_local int t_ctx_depth;

static int ctx_valid(CUcontext ctx) { return ctx && ctx->magic == CTX_MAGIC; }

static CUcontext current_ctx(void) { return t_ctx_depth > 0 ? t_ctx_stack[t_ctx_depth - 1] : NULL; }

/* Device of the current context, -1 when none is current. */
static int current_device(void) {
    CUcontext c = current_ctx();
    return ctx_valid(c) ? c->dev : -1;
}

static CUresult ctx_error(void) { return (CUresult)fake_get_ll("FAKE_CUDA_CTX_ERROR", 0); }

/* ------------------------------------------------------------------------- */
/* Occupancy: whether the GPU, as the fake NVML reports it, takes a context  */
/* ------------------------------------------------------------------------- */

#define FAKE_CUDA_ERROR_DEVICE_UNAVAILABLE 46
#define FAKE_DEFAULT_CONTEXT_MIB 500

static unsigned long long device_used_bytes(CUdevice dev);

/* Device memory a new context takes: hundreds of MiB on a real H100/H200. */
static unsigned long long context_bytes(void) {
    long long mib = fake_get_ll("FAKE_CUDA_CONTEXT_MIB", FAKE_DEFAULT_CONTEXT_MIB);
    return mib > 0 ? (unsigned long long)mib * FAKE_MIB : 0;
}

/* What the real driver answers to a new context on dev in its present state. */
static CUresult ctx_occupancy_error(CUdevice dev) {
    const visible_device *v = &g_visible[dev];
    long long mode = fake_compute_mode(v->gpu);
    if (mode == FAKE_COMPUTE_MODE_PROHIBITED) return FAKE_CUDA_ERROR_DEVICE_UNAVAILABLE;
    if ((mode == FAKE_COMPUTE_MODE_EXCLUSIVE_PROCESS || mode == FAKE_COMPUTE_MODE_EXCLUSIVE_THREAD) &&
        fake_foreign_process_on(v->gpu, v->mig, (long long)getpid()))
        return FAKE_CUDA_ERROR_DEVICE_UNAVAILABLE;
    unsigned long long total = device_total_bytes(dev), used = device_used_bytes(dev);
    if (used > total || total - used < context_bytes()) return CUDA_ERROR_OUT_OF_MEMORY;
    return CUDA_SUCCESS;
}

/*
 * With FAKE_CUDA_CONTEXT_LOG=PATH, appends one JSON line for an attempt on
 * ordinal dev ("event": "context", "alloc" or "copy"):
 *   {"event", "call" (driver entry point), "pid", "ordinal", "gpu" (physical
 *    index), "mig" (instance or null), "uuid" (the device's full GPU- or MIG-
 *    UUID), "gpu_uuid" (the physical GPU's), "result" (CUresult), "time" (Unix
 *    seconds), "cuda_visible_devices" (string or null), "bytes" (allocs and copies)}
 */
static void log_device_event(const char *event, const char *call, CUdevice dev, CUresult rc,
                             long long bytes) {
    char *path = fake_get_dup("FAKE_CUDA_CONTEXT_LOG");
    if (!path || !*fake_strip(path)) {
        free(path);
        return;
    }
    const visible_device *v = &g_visible[dev];
    char uuid[96], gpu_uuid[96];
    fake_gpu_uuid(v->gpu, gpu_uuid, sizeof gpu_uuid);
    if (v->mig >= 0)
        fake_mig_uuid(v->gpu, v->mig, uuid, sizeof uuid);
    else
        snprintf(uuid, sizeof uuid, "%s", gpu_uuid);
    long long now_us = fake_now_us();
    fake_line_t line = {.len = 0};
    fake_line_add(&line, "{\"event\": \"%s\", \"call\": ", event);
    fake_line_add_json_string(&line, call);
    fake_line_add(&line, ", \"pid\": %ld, \"ordinal\": %d, \"gpu\": %d, \"mig\": ", (long)getpid(),
                  dev, v->gpu);
    if (v->mig >= 0)
        fake_line_add(&line, "%d", v->mig);
    else
        fake_line_add(&line, "null");
    fake_line_add(&line, ", \"uuid\": \"%s\", \"gpu_uuid\": \"%s\", \"result\": %d", uuid, gpu_uuid, rc);
    fake_line_add(&line, ", \"time\": %lld.%06lld, \"cuda_visible_devices\": ", now_us / 1000000,
                  now_us % 1000000);
    fake_line_add_json_string(&line, getenv("CUDA_VISIBLE_DEVICES"));
    if (bytes >= 0) fake_line_add(&line, ", \"bytes\": %lld", bytes);
    fake_line_add(&line, "}");
    if (fake_append_line(fake_strip(path), &line) != 0)
        fprintf(stderr, "fake-cuda: cannot append to FAKE_CUDA_CONTEXT_LOG %s: %s\n", path,
                strerror(errno));
    free(path);
}

static CUresult ctx_create_checked(CUcontext *pctx, CUdevice dev) {
    CUresult err = ctx_error();
    if (!err) err = ctx_occupancy_error(dev);
    if (err) return err;
    struct fake_ctx *c = calloc(1, sizeof *c);
    if (!c) return CUDA_ERROR_OUT_OF_MEMORY;
    c->magic = CTX_MAGIC;
    c->dev = dev;
    if (t_ctx_depth >= CTX_STACK_MAX) {
        free(c);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    t_ctx_stack[t_ctx_depth++] = c; /* a new context becomes current */
    *pctx = c;
    return CUDA_SUCCESS;
}

/* FAKE_CUDA_WORK_SETS: append KEY=VALUE to the state file, once per process and GPU. */
static void work_side_effect(int dev) {
    static unsigned long long done; /* physical GPUs this process changed already */
    int gpu = g_visible[dev].gpu;
    if (gpu < 0 || gpu >= 64 || (done >> gpu) & 1ULL) return;
    char *knob = fake_get_dup("FAKE_CUDA_WORK_SETS");
    const char *path = getenv("FAKE_GPU_STATE_FILE");
    char *colon = knob ? strchr(knob, ':') : NULL;
    if (colon && path && *path && strchr(colon + 1, '=')) {
        *colon = '\0';
        long long idx;
        if (fake_parse_ll(knob, &idx) && idx == gpu) {
            done |= 1ULL << gpu;
            char tmp[4200];
            snprintf(tmp, sizeof tmp, "%s.ctx-%ld", path, (long)getpid());
            FILE *in = fopen(path, "r"), *out = fopen(tmp, "w");
            if (out) {
                int c;
                while (in && (c = fgetc(in)) != EOF) fputc(c, out);
                fprintf(out, "\n%s\n", colon + 1);
                if (fclose(out) == 0) rename(tmp, path);
            }
            if (in) fclose(in);
        }
    }
    free(knob);
}

static CUresult ctx_create(CUcontext *pctx, CUdevice dev, const char *call) {
    CHECK_DEVICE(dev);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = ctx_create_checked(pctx, dev);
    log_device_event("context", call, dev, rc, -1);
    return rc;
}

FAKE_EXPORT CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    TRACE_CALL();
    (void)flags;
    return ctx_create(pctx, dev, __func__);
}
FAKE_EXPORT CUresult cuCtxCreate(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    return cuCtxCreate_v2(pctx, flags, dev);
}
FAKE_EXPORT CUresult cuCtxCreate_v3(CUcontext *pctx, void *paramsArray, int numParams,
                                    unsigned int flags, CUdevice dev) {
    TRACE_CALL();
    (void)paramsArray;
    (void)numParams;
    (void)flags;
    return ctx_create(pctx, dev, __func__);
}
FAKE_EXPORT CUresult cuCtxCreate_v4(CUcontext *pctx, void *ctxCreateParams, unsigned int flags,
                                    CUdevice dev) {
    TRACE_CALL();
    (void)ctxCreateParams;
    (void)flags;
    return ctx_create(pctx, dev, __func__);
}

/* Drops every occurrence of ctx from this thread's stack. */
static void ctx_forget(CUcontext ctx) {
    int w = 0;
    for (int r = 0; r < t_ctx_depth; r++)
        if (t_ctx_stack[r] != ctx) t_ctx_stack[w++] = t_ctx_stack[r];
    t_ctx_depth = w;
}

FAKE_EXPORT CUresult cuCtxDestroy_v2(CUcontext ctx) {
    TRACE_CALL();
    CHECK_INIT();
    if (!ctx_valid(ctx) || ctx->primary) return CUDA_ERROR_INVALID_CONTEXT;
    ctx_forget(ctx);
    ctx->magic = 0;
    free(ctx);
    return CUDA_SUCCESS;
}
FAKE_EXPORT CUresult cuCtxDestroy(CUcontext ctx) { return cuCtxDestroy_v2(ctx); }

FAKE_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    TRACE_CALL();
    CHECK_INIT();
    if (!ctx) {
        if (t_ctx_depth > 0) t_ctx_depth--;
        return CUDA_SUCCESS;
    }
    if (!ctx_valid(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_ctx_depth == 0)
        t_ctx_stack[t_ctx_depth++] = ctx;
    else
        t_ctx_stack[t_ctx_depth - 1] = ctx;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx) {
    TRACE_CALL();
    CHECK_INIT();
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = current_ctx();
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    TRACE_CALL();
    CHECK_INIT();
    if (!ctx_valid(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
    if (t_ctx_depth >= CTX_STACK_MAX) return CUDA_ERROR_OUT_OF_MEMORY;
    t_ctx_stack[t_ctx_depth++] = ctx;
    return CUDA_SUCCESS;
}
FAKE_EXPORT CUresult cuCtxPushCurrent(CUcontext ctx) { return cuCtxPushCurrent_v2(ctx); }

FAKE_EXPORT CUresult cuCtxPopCurrent_v2(CUcontext *pctx) {
    TRACE_CALL();
    CHECK_INIT();
    if (t_ctx_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext c = t_ctx_stack[--t_ctx_depth];
    if (pctx) *pctx = c;
    return CUDA_SUCCESS;
}
FAKE_EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx) { return cuCtxPopCurrent_v2(pctx); }

FAKE_EXPORT CUresult cuCtxGetDevice(CUdevice *device) {
    TRACE_CALL();
    CHECK_INIT();
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    int dev = current_device();
    if (dev < 0) return CUDA_ERROR_INVALID_CONTEXT;
    *device = dev;
    return CUDA_SUCCESS;
}

static CUresult drain_host_functions(void);

FAKE_EXPORT CUresult cuCtxSynchronize(void) {
    TRACE_CALL();
    CHECK_INIT();
    if (current_device() < 0) return CUDA_ERROR_INVALID_CONTEXT;
    return drain_host_functions();
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = ctx_error();
    pthread_mutex_lock(&g_ctx_lock);
    /* Only the first retain creates the primary context; later ones share it. */
    if (!rc && g_primary_refs[dev] == 0) rc = ctx_occupancy_error(dev);
    if (!rc) {
        g_primary[dev].magic = CTX_MAGIC;
        g_primary[dev].dev = dev;
        g_primary[dev].primary = 1;
        g_primary_refs[dev]++;
    }
    pthread_mutex_unlock(&g_ctx_lock);
    log_device_event("context", __func__, dev, rc, -1);
    if (!rc) *pctx = &g_primary[dev];
    return rc;
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_ctx_lock);
    if (g_primary_refs[dev] <= 0)
        rc = CUDA_ERROR_INVALID_CONTEXT;
    else
        g_primary_refs[dev]--;
    pthread_mutex_unlock(&g_ctx_lock);
    return rc;
}
FAKE_EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev) { return cuDevicePrimaryCtxRelease_v2(dev); }

FAKE_EXPORT CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_ctx_lock);
    *flags = g_primary_flags[dev];
    *active = g_primary_refs[dev] > 0;
    pthread_mutex_unlock(&g_ctx_lock);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    pthread_mutex_lock(&g_ctx_lock);
    g_primary_flags[dev] = flags;
    pthread_mutex_unlock(&g_ctx_lock);
    return CUDA_SUCCESS;
}
FAKE_EXPORT CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
    return cuDevicePrimaryCtxSetFlags_v2(dev, flags);
}

FAKE_EXPORT CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    return CUDA_SUCCESS;
}
FAKE_EXPORT CUresult cuDevicePrimaryCtxReset(CUdevice dev) { return cuDevicePrimaryCtxReset_v2(dev); }

/* ------------------------------------------------------------------------- */
/* Host functions and stream ordering                                        */
/* ------------------------------------------------------------------------- */

/*
 * All device work in the fake completes synchronously inside the call that
 * issues it.  Host functions (cuLaunchHostFunc) run in order on one worker
 * thread, like the driver's callback thread; events and synchronisation wait
 * for the host functions enqueued before them.
 */
typedef struct hostfn_item {
    CUhostFn fn;
    void *data;
    struct hostfn_item *next;
} hostfn_item;

static pthread_mutex_t g_q_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_q_work = PTHREAD_COND_INITIALIZER;
static pthread_cond_t g_q_progress = PTHREAD_COND_INITIALIZER;
static hostfn_item *g_q_head, *g_q_tail;
static unsigned long long g_q_enqueued, g_q_done;
static pthread_once_t g_q_once = PTHREAD_ONCE_INIT;

static void *hostfn_worker(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&g_q_lock);
        while (!g_q_head) pthread_cond_wait(&g_q_work, &g_q_lock);
        hostfn_item *it = g_q_head;
        g_q_head = it->next;
        if (!g_q_head) g_q_tail = NULL;
        pthread_mutex_unlock(&g_q_lock);
        it->fn(it->data);
        free(it);
        pthread_mutex_lock(&g_q_lock);
        g_q_done++;
        pthread_cond_broadcast(&g_q_progress);
        pthread_mutex_unlock(&g_q_lock);
    }
    return NULL;
}

static void start_worker(void) {
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_create(&th, &attr, hostfn_worker, NULL);
    pthread_attr_destroy(&attr);
}

static unsigned long long hostfn_enqueued(void) {
    pthread_mutex_lock(&g_q_lock);
    unsigned long long n = g_q_enqueued;
    pthread_mutex_unlock(&g_q_lock);
    return n;
}

static int hostfn_reached(unsigned long long seq) {
    pthread_mutex_lock(&g_q_lock);
    int done = g_q_done >= seq;
    pthread_mutex_unlock(&g_q_lock);
    return done;
}

static void hostfn_wait(unsigned long long seq) {
    pthread_mutex_lock(&g_q_lock);
    while (g_q_done < seq) pthread_cond_wait(&g_q_progress, &g_q_lock);
    pthread_mutex_unlock(&g_q_lock);
}

static CUresult drain_host_functions(void) {
    hostfn_wait(hostfn_enqueued());
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------- */
/* Streams and events                                                        */
/* ------------------------------------------------------------------------- */

#define STREAM_MAGIC 0x57AE57AEu
#define EVENT_MAGIC 0xE7E7E7E7u

struct fake_stream {
    unsigned magic;
    unsigned flags;
};

struct fake_event {
    unsigned magic;
    unsigned flags;
    int recorded;
    unsigned long long seq; /* host functions that must finish first */
    long long time_us;
};

/* NULL is the legacy default stream and always valid. */
static int stream_ok(CUstream s) { return !s || s->magic == STREAM_MAGIC; }
static int event_ok(CUevent e) { return e && e->magic == EVENT_MAGIC; }

#define CHECK_CTX()                                                   \
    do {                                                              \
        CHECK_INIT();                                                 \
        if (current_device() < 0) return CUDA_ERROR_INVALID_CONTEXT; \
    } while (0)

FAKE_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int flags) {
    TRACE_CALL();
    CHECK_CTX();
    if (!phStream) return CUDA_ERROR_INVALID_VALUE;
    struct fake_stream *s = calloc(1, sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    s->magic = STREAM_MAGIC;
    s->flags = flags;
    *phStream = s;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
    TRACE_CALL();
    CHECK_INIT();
    if (!s || s->magic != STREAM_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    s->magic = 0;
    free(s);
    return CUDA_SUCCESS;
}
FAKE_EXPORT CUresult cuStreamDestroy(CUstream s) { return cuStreamDestroy_v2(s); }

FAKE_EXPORT CUresult cuStreamSynchronize(CUstream s) {
    TRACE_CALL();
    CHECK_INIT();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return drain_host_functions();
}

FAKE_EXPORT CUresult cuStreamQuery(CUstream s) {
    TRACE_CALL();
    CHECK_INIT();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return hostfn_reached(hostfn_enqueued()) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FAKE_EXPORT CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags) {
    TRACE_CALL();
    CHECK_INIT();
    (void)flags;
    if (!stream_ok(s) || !event_ok(e)) return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuLaunchHostFunc(CUstream s, CUhostFn fn, void *userData) {
    TRACE_CALL();
    CHECK_INIT();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    hostfn_item *it = calloc(1, sizeof *it);
    if (!it) return CUDA_ERROR_OUT_OF_MEMORY;
    it->fn = fn;
    it->data = userData;
    pthread_once(&g_q_once, start_worker);
    pthread_mutex_lock(&g_q_lock);
    if (g_q_tail)
        g_q_tail->next = it;
    else
        g_q_head = it;
    g_q_tail = it;
    g_q_enqueued++;
    pthread_cond_signal(&g_q_work);
    pthread_mutex_unlock(&g_q_lock);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int flags) {
    TRACE_CALL();
    CHECK_CTX();
    if (!phEvent) return CUDA_ERROR_INVALID_VALUE;
    struct fake_event *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    e->magic = EVENT_MAGIC;
    e->flags = flags;
    *phEvent = e;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuEventDestroy_v2(CUevent e) {
    TRACE_CALL();
    CHECK_INIT();
    if (!event_ok(e)) return CUDA_ERROR_INVALID_HANDLE;
    e->magic = 0;
    free(e);
    return CUDA_SUCCESS;
}
FAKE_EXPORT CUresult cuEventDestroy(CUevent e) { return cuEventDestroy_v2(e); }

static void event_record(CUevent e) {
    e->recorded = 1;
    e->seq = hostfn_enqueued();
    e->time_us = fake_now_us();
}

FAKE_EXPORT CUresult cuEventRecord(CUevent e, CUstream s) {
    TRACE_CALL();
    CHECK_INIT();
    if (!event_ok(e) || !stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    event_record(e);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuEventQuery(CUevent e) {
    TRACE_CALL();
    CHECK_INIT();
    if (!event_ok(e)) return CUDA_ERROR_INVALID_HANDLE;
    return hostfn_reached(e->seq) ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FAKE_EXPORT CUresult cuEventSynchronize(CUevent e) {
    TRACE_CALL();
    CHECK_INIT();
    if (!event_ok(e)) return CUDA_ERROR_INVALID_HANDLE;
    hostfn_wait(e->seq);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuEventElapsedTime(float *ms, CUevent start, CUevent end) {
    TRACE_CALL();
    CHECK_INIT();
    if (!ms) return CUDA_ERROR_INVALID_VALUE;
    if (!event_ok(start) || !event_ok(end) || !start->recorded || !end->recorded ||
        (start->flags & 0x2) || (end->flags & 0x2) /* CU_EVENT_DISABLE_TIMING */)
        return CUDA_ERROR_INVALID_HANDLE;
    *ms = (float)(end->time_us - start->time_us) / 1000.0f;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------------- */
/* Memory                                                                    */
/* ------------------------------------------------------------------------- */

/* Every device allocation carries this header in front of the returned pointer. */
#define ALLOC_HEADER 256u
#define ALLOC_MAGIC 0xA110CA7Eu

typedef struct {
    unsigned magic;
    int dev;
    size_t size;
} alloc_header;

static atomic_ullong g_allocated[MAX_VISIBLE];

/* Live allocations (base, size), for FAKE_CUDA_MEMORY_FAULT to find the one a copy reads. */
#define MAX_LIVE_ALLOCS 256
static struct { uintptr_t base; size_t size; } g_live[MAX_LIVE_ALLOCS];
static pthread_mutex_t g_live_lock = PTHREAD_MUTEX_INITIALIZER;

static void live_set(uintptr_t base, size_t size, int add) {
    pthread_mutex_lock(&g_live_lock);
    for (int i = 0; i < MAX_LIVE_ALLOCS; i++) {
        if (add ? g_live[i].base == 0 : g_live[i].base == base) {
            g_live[i].base = add ? base : 0;
            g_live[i].size = add ? size : 0;
            break;
        }
    }
    pthread_mutex_unlock(&g_live_lock);
}

static int live_allocation(uintptr_t p, uintptr_t *base, size_t *size) {
    int found = 0;
    pthread_mutex_lock(&g_live_lock);
    for (int i = 0; i < MAX_LIVE_ALLOCS && !found; i++) {
        if (g_live[i].base && p >= g_live[i].base && p < g_live[i].base + g_live[i].size) {
            *base = g_live[i].base;
            *size = g_live[i].size;
            found = 1;
        }
    }
    pthread_mutex_unlock(&g_live_lock);
    return found;
}

static unsigned long long device_used_bytes(CUdevice dev) {
    const visible_device *v = &g_visible[dev];
    long long mib = fake_list_ll("FAKE_NVML_MEMORY_USED_MIB", v->gpu, v->mig, 0);
    return (mib > 0 ? (unsigned long long)mib * FAKE_MIB : 0) + atomic_load(&g_allocated[dev]);
}

static CUresult device_alloc_on(int dev, CUdeviceptr *dptr, size_t size) {
    CUresult err = (CUresult)fake_get_ll("FAKE_CUDA_ALLOC_ERROR", 0);
    if (err) return err;
    unsigned long long total = device_total_bytes(dev), used = device_used_bytes(dev);
    if (used > total || size > total - used) return CUDA_ERROR_OUT_OF_MEMORY;
    void *p = NULL;
    if (size > SIZE_MAX - ALLOC_HEADER || posix_memalign(&p, ALLOC_HEADER, ALLOC_HEADER + size) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    alloc_header *h = p;
    h->magic = ALLOC_MAGIC;
    h->dev = dev;
    h->size = size;
    atomic_fetch_add(&g_allocated[dev], size);
    *dptr = (CUdeviceptr)(uintptr_t)((char *)p + ALLOC_HEADER);
    live_set((uintptr_t)*dptr, size, 1);
    return CUDA_SUCCESS;
}

static CUresult device_alloc(CUdeviceptr *dptr, size_t size, const char *call) {
    CHECK_CTX();
    if (!dptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    int dev = current_device();
    CUresult rc = device_alloc_on(dev, dptr, size);
    log_device_event("alloc", call, dev, rc, size > (size_t)LLONG_MAX ? LLONG_MAX : (long long)size);
    return rc;
}

static CUresult device_free(CUdeviceptr dptr) {
    CHECK_INIT();
    if (!dptr) return CUDA_SUCCESS;
    alloc_header *h = (alloc_header *)((char *)(uintptr_t)dptr - ALLOC_HEADER);
    if (h->magic != ALLOC_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    h->magic = 0;
    live_set((uintptr_t)dptr, 0, 0);
    atomic_fetch_sub(&g_allocated[h->dev], h->size);
    free(h);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    TRACE_CALL();
    return device_alloc(dptr, bytesize, __func__);
}

FAKE_EXPORT CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    TRACE_CALL();
    (void)flags;
    return device_alloc(dptr, bytesize, __func__);
}

FAKE_EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    TRACE_CALL();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return device_alloc(dptr, bytesize, __func__);
}

FAKE_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) {
    TRACE_CALL();
    return device_free(dptr);
}

FAKE_EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) {
    TRACE_CALL();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return device_free(dptr);
}

FAKE_EXPORT CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    TRACE_CALL();
    CHECK_CTX();
    if (!free_bytes || !total_bytes) return CUDA_ERROR_INVALID_VALUE;
    int dev = current_device();
    unsigned long long total = device_total_bytes(dev), used = device_used_bytes(dev);
    *total_bytes = (size_t)total;
    *free_bytes = (size_t)(used < total ? total - used : 0);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags) {
    TRACE_CALL();
    CHECK_CTX();
    (void)flags;
    if (!pp || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    void *p = NULL;
    if (posix_memalign(&p, 4096, bytesize) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    *pp = p;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemFreeHost(void *p) {
    TRACE_CALL();
    CHECK_INIT();
    free(p);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int flags) {
    TRACE_CALL();
    CHECK_CTX();
    (void)flags;
    if (!p || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}
FAKE_EXPORT CUresult cuMemHostRegister(void *p, size_t bytesize, unsigned int flags) {
    return cuMemHostRegister_v2(p, bytesize, flags);
}

FAKE_EXPORT CUresult cuMemHostUnregister(void *p) {
    TRACE_CALL();
    CHECK_CTX();
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Host memory is directly addressable by the fake "device". */
FAKE_EXPORT CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int flags) {
    TRACE_CALL();
    CHECK_CTX();
    if (!pdptr || !p || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    *pdptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemPrefetchAsync(CUdeviceptr dptr, size_t count, CUdevice dev, CUstream s) {
    TRACE_CALL();
    CHECK_INIT();
    (void)dptr;
    (void)count;
    (void)dev;
    return stream_ok(s) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

static void *dptr_to_host(CUdeviceptr p) { return (void *)(uintptr_t)p; }

/* Which way a copy goes: the bandwidth knob charges DtoD twice (it reads and writes). */
typedef enum { COPY_ANY, COPY_HTOD, COPY_DTOH, COPY_DTOD } copy_kind;

/*
 * Copy timing and faults, per physical GPU of the current context (qualification's measures):
 *   FAKE_CUDA_COPY_GBPS=IDX:GBPS      copies on GPU IDX move bytes at GBPS * 1e9 bytes/s:
 *                                     the copy returns once bytes / rate has passed (a
 *                                     device-to-device copy moves 2 x its size, read and
 *                                     written). Unset: as fast as memmove.
 *   FAKE_CUDA_CORRUPT_COPY=IDX:OFFSET every device-to-host copy on GPU IDX returns the byte
 *                                     at OFFSET (mod the size) flipped (XOR 0xFF): a GPU
 *                                     that returns a wrong byte.
 * With FAKE_CUDA_CONTEXT_LOG set, each synchronous copy appends an "event": "copy" line
 * (call, bytes, time at its end): proof of what ran on a GPU and when.
 */
static void copy_faults(copy_kind kind, void *dst, size_t n, long long started_us) {
    int dev = current_device();
    if (dev < 0) return;
    int gpu = g_visible[dev].gpu;
    long long mbps = 0; /* MB/s: GBPS may be fractional ("0.5") */
    char rate[64];
    if (fake_list_str("FAKE_CUDA_COPY_GBPS", gpu, -1, rate, sizeof rate)) {
        double gbps = strtod(rate, NULL);
        mbps = gbps > 0 ? (long long)(gbps * 1000.0) : 0;
    }
    if (kind == COPY_DTOH) {
        long long off = fake_list_ll("FAKE_CUDA_CORRUPT_COPY", gpu, -1, -1);
        if (off >= 0) ((unsigned char *)dst)[(size_t)off % n] ^= 0xFF;
    }
    if (mbps > 0) {
        double moved = (double)n * (kind == COPY_DTOD ? 2.0 : 1.0);
        long long want_us = (long long)(moved / ((double)mbps * 1e6) * 1e6);
        long long left_us = started_us + want_us - fake_now_us();
        if (left_us > 0) {
            struct timespec ts = {left_us / 1000000, (left_us % 1000000) * 1000};
            while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
            }
        }
    }
}

/*
 * FAKE_CUDA_MEMORY_FAULT=IDX:OFFSET:BIT[:MODE]: a device-to-host copy from an allocation on
 * GPU IDX that covers the allocation's byte OFFSET (mod its size) returns that byte with bit
 * BIT flipped (flip), cleared (stuck0) or set (stuck1): one bad memory cell, as a memory test
 * sees it. Copies whose source is not the fake's device memory are left alone.
 */
static void memory_fault(void *dst, const void *src, size_t n) {
    int dev = current_device();
    if (dev < 0) return;
    char spec[96];
    if (!fake_list_str("FAKE_CUDA_MEMORY_FAULT", g_visible[dev].gpu, -1, spec, sizeof spec)) return;
    unsigned long long offset = 0;
    unsigned bit = 0;
    char mode[16] = "flip";
    if (sscanf(spec, "%llu:%u:%15s", &offset, &bit, mode) < 2) return;
    uintptr_t base = 0;
    size_t size = 0;
    if (!live_allocation((uintptr_t)src, &base, &size) || size == 0) return;
    uintptr_t cell = base + (uintptr_t)(offset % size);
    if (cell < (uintptr_t)src || cell >= (uintptr_t)src + n) return;
    unsigned char *b = (unsigned char *)dst + (cell - (uintptr_t)src);
    unsigned char m = (unsigned char)(1u << (bit % 8));
    if (strcmp(mode, "stuck0") == 0) *b &= (unsigned char)~m;
    else if (strcmp(mode, "stuck1") == 0) *b |= m;
    else *b ^= m;
}

static CUresult do_copy(copy_kind kind, void *dst, const void *src, size_t n, const char *call) {
    CHECK_INIT();
    if (n == 0) return CUDA_SUCCESS;
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    long long started_us = fake_now_us();
    memmove(dst, src, n);
    if (kind == COPY_DTOH) memory_fault(dst, src, n);
    if (kind != COPY_ANY) copy_faults(kind, dst, n, started_us);
    int dev = current_device();
    if (kind != COPY_ANY && dev >= 0)
        log_device_event("copy", call, dev, CUDA_SUCCESS, n > (size_t)LLONG_MAX ? LLONG_MAX : (long long)n);
    if (kind == COPY_DTOD && dev >= 0) work_side_effect(dev);
    return CUDA_SUCCESS;
}

static CUresult do_memcpy(void *dst, const void *src, size_t n) {
    return do_copy(COPY_ANY, dst, src, n, "memcpy");
}

FAKE_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    TRACE_CALL();
    return do_memcpy(dptr_to_host(dst), dptr_to_host(src), n);
}
FAKE_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    TRACE_CALL();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return do_memcpy(dptr_to_host(dst), dptr_to_host(src), n);
}
FAKE_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    TRACE_CALL();
    return do_copy(COPY_HTOD, dptr_to_host(dst), src, n, __func__);
}
FAKE_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    TRACE_CALL();
    return do_copy(COPY_DTOH, dst, dptr_to_host(src), n, __func__);
}
FAKE_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    TRACE_CALL();
    return do_copy(COPY_DTOD, dptr_to_host(dst), dptr_to_host(src), n, __func__);
}
FAKE_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    TRACE_CALL();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return do_memcpy(dptr_to_host(dst), src, n);
}
FAKE_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    TRACE_CALL();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return do_memcpy(dst, dptr_to_host(src), n);
}
FAKE_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    TRACE_CALL();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return do_memcpy(dptr_to_host(dst), dptr_to_host(src), n);
}

/* Fills `count` elements of elem_size bytes (1, 2 or 4) with value. */
static CUresult do_memset(CUdeviceptr dst, unsigned int value, size_t elem_size, size_t count) {
    CHECK_INIT();
    if (count == 0) return CUDA_SUCCESS;
    if (!dst) return CUDA_ERROR_INVALID_VALUE;
    unsigned char *p = dptr_to_host(dst);
    for (size_t i = 0; i < count; i++) {
        switch (elem_size) {
        case 1: p[i] = (unsigned char)value; break;
        case 2: { unsigned short v = (unsigned short)value; memcpy(p + 2 * i, &v, 2); break; }
        default: memcpy(p + 4 * i, &value, 4); break;
        }
    }
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n) {
    TRACE_CALL();
    return do_memset(dst, uc, 1, n);
}
FAKE_EXPORT CUresult cuMemsetD16_v2(CUdeviceptr dst, unsigned short us, size_t n) {
    TRACE_CALL();
    return do_memset(dst, us, 2, n);
}
FAKE_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int ui, size_t n) {
    TRACE_CALL();
    return do_memset(dst, ui, 4, n);
}
FAKE_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s) {
    TRACE_CALL();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return do_memset(dst, uc, 1, n);
}
FAKE_EXPORT CUresult cuMemsetD16Async(CUdeviceptr dst, unsigned short us, size_t n, CUstream s) {
    TRACE_CALL();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return do_memset(dst, us, 2, n);
}
FAKE_EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int ui, size_t n, CUstream s) {
    TRACE_CALL();
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return do_memset(dst, ui, 4, n);
}

/* ------------------------------------------------------------------------- */
/* Memory pools                                                              */
/* ------------------------------------------------------------------------- */

#define POOL_MAGIC 0x9001900Du

struct fake_mempool {
    unsigned magic;
    int is_default;
    int reuse[3];                /* CU_MEMPOOL_ATTR_REUSE_* (1..3), int-valued */
    cuuint64_t release_threshold; /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD (4) */
};

static struct fake_mempool g_default_pools[MAX_VISIBLE];

static int pool_ok(CUmemoryPool p) { return p && p->magic == POOL_MAGIC; }

FAKE_EXPORT CUresult cuMemPoolCreate(CUmemoryPool *pool, const void *props) {
    TRACE_CALL();
    CHECK_INIT();
    if (!pool || !props) return CUDA_ERROR_INVALID_VALUE;
    struct fake_mempool *p = calloc(1, sizeof *p);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    p->magic = POOL_MAGIC;
    *pool = p;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    TRACE_CALL();
    CHECK_INIT();
    if (!pool_ok(pool) || pool->is_default) return CUDA_ERROR_INVALID_VALUE;
    pool->magic = 0;
    free(pool);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemPoolSetAccess(CUmemoryPool pool, const void *map, size_t count) {
    TRACE_CALL();
    CHECK_INIT();
    (void)map;
    (void)count;
    return pool_ok(pool) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_EXPORT CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    TRACE_CALL();
    CHECK_INIT();
    if (!pool_ok(pool) || !value) return CUDA_ERROR_INVALID_VALUE;
    if (attr >= 1 && attr <= 3)
        pool->reuse[attr - 1] = *(int *)value;
    else if (attr == 4)
        pool->release_threshold = *(cuuint64_t *)value;
    else if (attr < 1 || attr > 8)
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS; /* resetting the high-water marks (6, 8) is a no-op */
}

FAKE_EXPORT CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    TRACE_CALL();
    CHECK_INIT();
    if (!pool_ok(pool) || !value) return CUDA_ERROR_INVALID_VALUE;
    if (attr >= 1 && attr <= 3)
        *(int *)value = pool->reuse[attr - 1];
    else if (attr == 4)
        *(cuuint64_t *)value = pool->release_threshold;
    else if (attr >= 5 && attr <= 8)
        *(cuuint64_t *)value = 0; /* reserved/used current/high: allocations bypass pools */
    else
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    TRACE_CALL();
    CHECK_INIT();
    (void)minBytesToKeep;
    return pool_ok(pool) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

FAKE_EXPORT CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                             CUstream s) {
    TRACE_CALL();
    CHECK_INIT();
    if (!pool_ok(pool)) return CUDA_ERROR_INVALID_VALUE;
    if (!stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return device_alloc(dptr, bytesize, __func__);
}

FAKE_EXPORT CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *pool, CUdevice dev) {
    TRACE_CALL();
    CHECK_DEVICE(dev);
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    g_default_pools[dev].magic = POOL_MAGIC;
    g_default_pools[dev].is_default = 1;
    *pool = &g_default_pools[dev];
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    return cuDeviceGetDefaultMemPool(pool, dev);
}

/* ------------------------------------------------------------------------- */
/* Modules and kernels (accepted, never executed)                            */
/* ------------------------------------------------------------------------- */

#define MODULE_MAGIC 0x30D030D0u

struct fake_module {
    unsigned magic;
};
struct fake_function {
    unsigned magic;
};

/* One function object stands for every kernel: launches do nothing anyway. */
static struct fake_function g_function = {MODULE_MAGIC};

static CUresult launch_error(void) { return (CUresult)fake_get_ll("FAKE_CUDA_LAUNCH_ERROR", 0); }

FAKE_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                        void *options, void **optionValues) {
    TRACE_CALL();
    CHECK_CTX();
    (void)numOptions;
    (void)options;
    (void)optionValues;
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    struct fake_module *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    m->magic = MODULE_MAGIC;
    *module = m;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    return cuModuleLoadDataEx(module, image, 0, NULL, NULL);
}

FAKE_EXPORT CUresult cuModuleUnload(CUmodule module) {
    TRACE_CALL();
    CHECK_INIT();
    if (!module || module->magic != MODULE_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    module->magic = 0;
    free(module);
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule module, const char *name) {
    TRACE_CALL();
    CHECK_INIT();
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!module || module->magic != MODULE_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    *hfunc = &g_function;
    return CUDA_SUCCESS;
}

/* The fake image defines no globals. */
FAKE_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule module,
                                          const char *name) {
    TRACE_CALL();
    CHECK_INIT();
    (void)dptr;
    (void)bytes;
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    if (!module || module->magic != MODULE_MAGIC) return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_ERROR_NOT_FOUND;
}

FAKE_EXPORT CUresult cuFuncSetAttribute(CUfunction f, int attrib, int value) {
    TRACE_CALL();
    CHECK_INIT();
    (void)attrib;
    (void)value;
    return f ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

FAKE_EXPORT CUresult cuFuncGetAttribute(int *pi, int attrib, CUfunction f) {
    TRACE_CALL();
    CHECK_INIT();
    (void)attrib;
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    *pi = attrib == 0 ? 1024 : 0; /* MAX_THREADS_PER_BLOCK, else 0 */
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                    unsigned int gridDimZ, unsigned int blockDimX,
                                    unsigned int blockDimY, unsigned int blockDimZ,
                                    unsigned int sharedMemBytes, CUstream s, void **kernelParams,
                                    void **extra) {
    TRACE_CALL();
    CHECK_CTX();
    (void)gridDimX, (void)gridDimY, (void)gridDimZ;
    (void)blockDimX, (void)blockDimY, (void)blockDimZ;
    (void)sharedMemBytes, (void)kernelParams, (void)extra;
    if (!f || !stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    return launch_error();
}

/* ------------------------------------------------------------------------- */
/* Graphs: memcpy/memset/event nodes are replayed in insertion order         */
/* ------------------------------------------------------------------------- */

#define GRAPH_MAGIC 0x67A9067Au

enum node_kind { NODE_EMPTY, NODE_KERNEL, NODE_MEMCPY, NODE_MEMSET, NODE_EVENT_RECORD };

struct fake_graph_node {
    enum node_kind kind;
    CUDA_MEMCPY3D copy;
    CUDA_MEMSET_NODE_PARAMS set;
    CUevent event;
    struct fake_graph_node *next;
};

struct fake_graph {
    unsigned magic;
    struct fake_graph_node *head, *tail;
    size_t count;
};

struct fake_graph_exec {
    unsigned magic;
    size_t count;
    struct fake_graph_node *nodes; /* a copy, so the graph may be destroyed first */
};

static int graph_ok(CUgraph g) { return g && g->magic == GRAPH_MAGIC; }

FAKE_EXPORT CUresult cuGraphCreate(CUgraph *phGraph, unsigned int flags) {
    TRACE_CALL();
    CHECK_INIT();
    if (!phGraph || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    struct fake_graph *g = calloc(1, sizeof *g);
    if (!g) return CUDA_ERROR_OUT_OF_MEMORY;
    g->magic = GRAPH_MAGIC;
    *phGraph = g;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphDestroy(CUgraph g) {
    TRACE_CALL();
    CHECK_INIT();
    if (!graph_ok(g)) return CUDA_ERROR_INVALID_VALUE;
    for (struct fake_graph_node *n = g->head, *next; n; n = next) {
        next = n->next;
        free(n);
    }
    g->magic = 0;
    free(g);
    return CUDA_SUCCESS;
}

static CUresult add_node(CUgraphNode *out, CUgraph g, const CUgraphNode *deps, size_t ndeps,
                         enum node_kind kind, struct fake_graph_node **node) {
    CHECK_INIT();
    if (!out || !graph_ok(g) || (ndeps > 0 && !deps)) return CUDA_ERROR_INVALID_VALUE;
    struct fake_graph_node *n = calloc(1, sizeof *n);
    if (!n) return CUDA_ERROR_OUT_OF_MEMORY;
    n->kind = kind;
    if (g->tail)
        g->tail->next = n;
    else
        g->head = n;
    g->tail = n;
    g->count++;
    *out = n;
    *node = n;
    return CUDA_SUCCESS;
}

FAKE_EXPORT CUresult cuGraphAddEmptyNode(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps,
                                         size_t ndeps) {
    TRACE_CALL();
    struct fake_graph_node *n;
    return add_node(phNode, g, deps, ndeps, NODE_EMPTY, &n);
}

FAKE_EXPORT CUresult cuGraphAddKernelNode(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps,
                                          size_t ndeps, const void *nodeParams) {
    TRACE_CALL();
    struct fake_graph_node *n;
    if (!nodeParams) return CUDA_ERROR_INVALID_VALUE;
    return add_node(phNode, g, deps, ndeps, NODE_KERNEL, &n);
}
FAKE_EXPORT CUresult cuGraphAddKernelNode_v2(CUgraphNode *phNode, CUgraph g,
                                             const CUgraphNode *deps, size_t ndeps,
                                             const void *nodeParams) {
    return cuGraphAddKernelNode(phNode, g, deps, ndeps, nodeParams);
}

FAKE_EXPORT CUresult cuGraphAddMemcpyNode(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps,
                                          size_t ndeps, const CUDA_MEMCPY3D *copyParams,
                                          CUcontext ctx) {
    TRACE_CALL();
    (void)ctx;
    struct fake_graph_node *n;
    if (!copyParams) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = add_node(phNode, g, deps, ndeps, NODE_MEMCPY, &n);
    if (rc == CUDA_SUCCESS) n->copy = *copyParams;
    return rc;
}

FAKE_EXPORT CUresult cuGraphAddMemsetNode(CUgraphNode *phNode, CUgraph g, const CUgraphNode *deps,
                                          size_t ndeps, const CUDA_MEMSET_NODE_PARAMS *memsetParams,
                                          CUcontext ctx) {
    TRACE_CALL();
    (void)ctx;
    struct fake_graph_node *n;
    if (!memsetParams) return CUDA_ERROR_INVALID_VALUE;
    unsigned es = memsetParams->elementSize;
    if (es != 1 && es != 2 && es != 4) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = add_node(phNode, g, deps, ndeps, NODE_MEMSET, &n);
    if (rc == CUDA_SUCCESS) n->set = *memsetParams;
    return rc;
}

FAKE_EXPORT CUresult cuGraphAddEventRecordNode(CUgraphNode *phNode, CUgraph g,
                                               const CUgraphNode *deps, size_t ndeps, CUevent e) {
    TRACE_CALL();
    struct fake_graph_node *n;
    if (!event_ok(e)) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = add_node(phNode, g, deps, ndeps, NODE_EVENT_RECORD, &n);
    if (rc == CUDA_SUCCESS) n->event = e;
    return rc;
}

FAKE_EXPORT CUresult cuGraphGetNodes(CUgraph g, CUgraphNode *nodes, size_t *numNodes) {
    TRACE_CALL();
    CHECK_INIT();
    if (!graph_ok(g) || !numNodes) return CUDA_ERROR_INVALID_VALUE;
    if (!nodes) {
        *numNodes = g->count;
        return CUDA_SUCCESS;
    }
    size_t k = 0;
    for (struct fake_graph_node *n = g->head; n && k < *numNodes; n = n->next) nodes[k++] = n;
    *numNodes = k;
    return CUDA_SUCCESS;
}

static CUresult graph_instantiate(CUgraphExec *phExec, CUgraph g) {
    CHECK_INIT();
    if (!phExec || !graph_ok(g)) return CUDA_ERROR_INVALID_VALUE;
    struct fake_graph_exec *x = calloc(1, sizeof *x);
    if (!x) return CUDA_ERROR_OUT_OF_MEMORY;
    x->nodes = calloc(g->count ? g->count : 1, sizeof *x->nodes);
    if (!x->nodes) {
        free(x);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (struct fake_graph_node *n = g->head; n; n = n->next) {
        x->nodes[x->count] = *n;
        x->nodes[x->count].next = NULL;
        x->count++;
    }
    x->magic = GRAPH_MAGIC;
    *phExec = x;
    return CUDA_SUCCESS;
}

/* The CUDA 11 signature, which cuGetProcAddress hands out below version 12000. */
FAKE_EXPORT CUresult cuGraphInstantiate_v2(CUgraphExec *phExec, CUgraph g, CUgraphNode *phErrorNode,
                                           char *logBuffer, size_t bufferSize) {
    TRACE_CALL();
    (void)phErrorNode;
    if (logBuffer && bufferSize > 0) logBuffer[0] = '\0';
    return graph_instantiate(phExec, g);
}

FAKE_EXPORT CUresult cuGraphInstantiateWithFlags(CUgraphExec *phExec, CUgraph g,
                                                 unsigned long long flags) {
    TRACE_CALL();
    (void)flags;
    return graph_instantiate(phExec, g);
}

FAKE_EXPORT CUresult cuGraphExecDestroy(CUgraphExec x) {
    TRACE_CALL();
    CHECK_INIT();
    if (!x || x->magic != GRAPH_MAGIC) return CUDA_ERROR_INVALID_VALUE;
    x->magic = 0;
    free(x->nodes);
    free(x);
    return CUDA_SUCCESS;
}

static void run_memcpy3d(const CUDA_MEMCPY3D *c) {
    const unsigned char *src = c->srcMemoryType == CU_MEMORYTYPE_HOST
                                   ? (const unsigned char *)c->srcHost
                                   : (const unsigned char *)dptr_to_host(c->srcDevice);
    unsigned char *dst = c->dstMemoryType == CU_MEMORYTYPE_HOST ? (unsigned char *)c->dstHost
                                                                : (unsigned char *)dptr_to_host(c->dstDevice);
    if (!src || !dst) return;
    size_t height = c->Height ? c->Height : 1, depth = c->Depth ? c->Depth : 1;
    for (size_t z = 0; z < depth; z++) {
        for (size_t y = 0; y < height; y++) {
            size_t so = c->srcXInBytes + (c->srcY + y) * c->srcPitch +
                        (c->srcZ + z) * c->srcPitch * c->srcHeight;
            size_t d_o = c->dstXInBytes + (c->dstY + y) * c->dstPitch +
                         (c->dstZ + z) * c->dstPitch * c->dstHeight;
            memmove(dst + d_o, src + so, c->WidthInBytes);
        }
    }
}

static void run_memset2d(const CUDA_MEMSET_NODE_PARAMS *m) {
    size_t height = m->height ? m->height : 1;
    for (size_t y = 0; y < height; y++)
        do_memset(m->dst + y * m->pitch, m->value, m->elementSize, m->width);
}

FAKE_EXPORT CUresult cuGraphLaunch(CUgraphExec x, CUstream s) {
    TRACE_CALL();
    CHECK_CTX();
    if (!x || x->magic != GRAPH_MAGIC || !stream_ok(s)) return CUDA_ERROR_INVALID_HANDLE;
    for (size_t k = 0; k < x->count; k++) {
        if (x->nodes[k].kind == NODE_KERNEL) {
            CUresult err = launch_error();
            if (err) return err;
        }
    }
    for (size_t k = 0; k < x->count; k++) {
        const struct fake_graph_node *n = &x->nodes[k];
        switch (n->kind) {
        case NODE_MEMCPY: run_memcpy3d(&n->copy); break;
        case NODE_MEMSET: run_memset2d(&n->set); break;
        case NODE_EVENT_RECORD:
            if (event_ok(n->event)) event_record(n->event);
            break;
        case NODE_EMPTY:
        case NODE_KERNEL: break;
        }
    }
    return CUDA_SUCCESS;
}

/*
 * The driver's private tables (cudart asks for several by UUID).  The fake has none; an
 * error answer lets cudart go on without them, where a missing entry point would make it
 * install a stub that fails every runtime call with cudaErrorCallRequiresNewerDriver.
 */
FAKE_EXPORT CUresult cuGetExportTable(const void **ppExportTable, const CUuuid *pExportTableId) {
    if (!ppExportTable || !pExportTableId) return CUDA_ERROR_INVALID_VALUE;
    const unsigned char *b = (const unsigned char *)pExportTableId->bytes;
    trace("cuGetExportTable(%02x%02x%02x%02x-...) -> CUDA_ERROR_NOT_FOUND", b[0], b[1], b[2], b[3]);
    *ppExportTable = NULL;
    return CUDA_ERROR_NOT_FOUND;
}

/* ------------------------------------------------------------------------- */
/* cuGetProcAddress                                                          */
/* ------------------------------------------------------------------------- */

typedef void (*generic_fn)(void);

typedef struct {
    const char *name;  /* base name, as passed to cuGetProcAddress */
    int min_version;   /* entry applies to cudaVersion >= min_version */
    generic_fn fn;
} proc_entry;

FAKE_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
FAKE_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags, int *symbolStatus);

#define PROC(name, ver, impl) {name, ver, (generic_fn)(impl)}

/*
 * Base names map to the versioned implementation the real driver hands out;
 * where the signature changed, the newest entry whose min_version the caller's
 * cudaVersion reaches wins (entries of a name are listed newest first).
 */
static const proc_entry g_procs[] = {
    PROC("cuGetErrorName", 0, cuGetErrorName),
    PROC("cuGetErrorString", 0, cuGetErrorString),
    PROC("cuGetProcAddress", 12000, cuGetProcAddress_v2),
    PROC("cuGetProcAddress", 0, cuGetProcAddress),
    PROC("cuInit", 0, cuInit),
    PROC("cuDriverGetVersion", 0, cuDriverGetVersion),
    PROC("cuGetExportTable", 0, cuGetExportTable),
    PROC("cuDeviceGet", 0, cuDeviceGet),
    PROC("cuDeviceGetCount", 0, cuDeviceGetCount),
    PROC("cuDeviceGetName", 0, cuDeviceGetName),
    PROC("cuDeviceGetUuid", 0, cuDeviceGetUuid_v2),
    PROC("cuDeviceTotalMem", 0, cuDeviceTotalMem_v2),
    PROC("cuDeviceGetAttribute", 0, cuDeviceGetAttribute),
    PROC("cuDeviceComputeCapability", 0, cuDeviceComputeCapability),
    PROC("cuDeviceGetPCIBusId", 0, cuDeviceGetPCIBusId),
    PROC("cuDeviceGetByPCIBusId", 0, cuDeviceGetByPCIBusId),
    PROC("cuDeviceCanAccessPeer", 0, cuDeviceCanAccessPeer),
    PROC("cuDeviceGetDefaultMemPool", 0, cuDeviceGetDefaultMemPool),
    PROC("cuDeviceGetMemPool", 0, cuDeviceGetMemPool),
    PROC("cuDevicePrimaryCtxRetain", 0, cuDevicePrimaryCtxRetain),
    PROC("cuDevicePrimaryCtxRelease", 0, cuDevicePrimaryCtxRelease_v2),
    PROC("cuDevicePrimaryCtxGetState", 0, cuDevicePrimaryCtxGetState),
    PROC("cuDevicePrimaryCtxSetFlags", 0, cuDevicePrimaryCtxSetFlags_v2),
    PROC("cuDevicePrimaryCtxReset", 0, cuDevicePrimaryCtxReset_v2),
    PROC("cuCtxCreate", 12050, cuCtxCreate_v4),
    PROC("cuCtxCreate", 11040, cuCtxCreate_v3),
    PROC("cuCtxCreate", 0, cuCtxCreate_v2),
    PROC("cuCtxDestroy", 0, cuCtxDestroy_v2),
    PROC("cuCtxSetCurrent", 0, cuCtxSetCurrent),
    PROC("cuCtxGetCurrent", 0, cuCtxGetCurrent),
    PROC("cuCtxPushCurrent", 0, cuCtxPushCurrent_v2),
    PROC("cuCtxPopCurrent", 0, cuCtxPopCurrent_v2),
    PROC("cuCtxGetDevice", 0, cuCtxGetDevice),
    PROC("cuCtxSynchronize", 0, cuCtxSynchronize),
    PROC("cuMemAlloc", 0, cuMemAlloc_v2),
    PROC("cuMemAllocManaged", 0, cuMemAllocManaged),
    PROC("cuMemAllocAsync", 0, cuMemAllocAsync),
    PROC("cuMemAllocFromPoolAsync", 0, cuMemAllocFromPoolAsync),
    PROC("cuMemFree", 0, cuMemFree_v2),
    PROC("cuMemFreeAsync", 0, cuMemFreeAsync),
    PROC("cuMemGetInfo", 0, cuMemGetInfo_v2),
    PROC("cuMemHostAlloc", 0, cuMemHostAlloc),
    PROC("cuMemFreeHost", 0, cuMemFreeHost),
    PROC("cuMemHostRegister", 0, cuMemHostRegister_v2),
    PROC("cuMemHostUnregister", 0, cuMemHostUnregister),
    PROC("cuMemHostGetDevicePointer", 0, cuMemHostGetDevicePointer_v2),
    PROC("cuMemPrefetchAsync", 0, cuMemPrefetchAsync),
    PROC("cuMemcpy", 0, cuMemcpy),
    PROC("cuMemcpyAsync", 0, cuMemcpyAsync),
    PROC("cuMemcpyHtoD", 0, cuMemcpyHtoD_v2),
    PROC("cuMemcpyDtoH", 0, cuMemcpyDtoH_v2),
    PROC("cuMemcpyDtoD", 0, cuMemcpyDtoD_v2),
    PROC("cuMemcpyHtoDAsync", 0, cuMemcpyHtoDAsync_v2),
    PROC("cuMemcpyDtoHAsync", 0, cuMemcpyDtoHAsync_v2),
    PROC("cuMemcpyDtoDAsync", 0, cuMemcpyDtoDAsync_v2),
    PROC("cuMemsetD8", 0, cuMemsetD8_v2),
    PROC("cuMemsetD16", 0, cuMemsetD16_v2),
    PROC("cuMemsetD32", 0, cuMemsetD32_v2),
    PROC("cuMemsetD8Async", 0, cuMemsetD8Async),
    PROC("cuMemsetD16Async", 0, cuMemsetD16Async),
    PROC("cuMemsetD32Async", 0, cuMemsetD32Async),
    PROC("cuMemPoolCreate", 0, cuMemPoolCreate),
    PROC("cuMemPoolDestroy", 0, cuMemPoolDestroy),
    PROC("cuMemPoolSetAccess", 0, cuMemPoolSetAccess),
    PROC("cuMemPoolGetAttribute", 0, cuMemPoolGetAttribute),
    PROC("cuMemPoolSetAttribute", 0, cuMemPoolSetAttribute),
    PROC("cuMemPoolTrimTo", 0, cuMemPoolTrimTo),
    PROC("cuStreamCreate", 0, cuStreamCreate),
    PROC("cuStreamDestroy", 0, cuStreamDestroy_v2),
    PROC("cuStreamSynchronize", 0, cuStreamSynchronize),
    PROC("cuStreamQuery", 0, cuStreamQuery),
    PROC("cuStreamWaitEvent", 0, cuStreamWaitEvent),
    PROC("cuEventCreate", 0, cuEventCreate),
    PROC("cuEventDestroy", 0, cuEventDestroy_v2),
    PROC("cuEventRecord", 0, cuEventRecord),
    PROC("cuEventQuery", 0, cuEventQuery),
    PROC("cuEventSynchronize", 0, cuEventSynchronize),
    PROC("cuEventElapsedTime", 0, cuEventElapsedTime),
    PROC("cuModuleLoadData", 0, cuModuleLoadData),
    PROC("cuModuleLoadDataEx", 0, cuModuleLoadDataEx),
    PROC("cuModuleUnload", 0, cuModuleUnload),
    PROC("cuModuleGetFunction", 0, cuModuleGetFunction),
    PROC("cuModuleGetGlobal", 0, cuModuleGetGlobal_v2),
    PROC("cuFuncSetAttribute", 0, cuFuncSetAttribute),
    PROC("cuFuncGetAttribute", 0, cuFuncGetAttribute),
    PROC("cuLaunchKernel", 0, cuLaunchKernel),
    PROC("cuLaunchHostFunc", 0, cuLaunchHostFunc),
    PROC("cuGraphCreate", 0, cuGraphCreate),
    PROC("cuGraphDestroy", 0, cuGraphDestroy),
    PROC("cuGraphAddEmptyNode", 0, cuGraphAddEmptyNode),
    PROC("cuGraphAddKernelNode", 0, cuGraphAddKernelNode),
    PROC("cuGraphAddMemcpyNode", 0, cuGraphAddMemcpyNode),
    PROC("cuGraphAddMemsetNode", 0, cuGraphAddMemsetNode),
    PROC("cuGraphAddEventRecordNode", 0, cuGraphAddEventRecordNode),
    PROC("cuGraphGetNodes", 0, cuGraphGetNodes),
    PROC("cuGraphInstantiate", 12000, cuGraphInstantiateWithFlags),
    PROC("cuGraphInstantiate", 0, cuGraphInstantiate_v2),
    PROC("cuGraphInstantiateWithFlags", 0, cuGraphInstantiateWithFlags),
    PROC("cuGraphLaunch", 0, cuGraphLaunch),
    PROC("cuGraphExecDestroy", 0, cuGraphExecDestroy),
};

#define CU_GET_PROC_ADDRESS_SUCCESS 0
#define CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND 1

static CUresult lookup_proc(const char *symbol, void **pfn, int cudaVersion, int *status) {
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++) {
        if (strcmp(g_procs[i].name, symbol) == 0 && cudaVersion >= g_procs[i].min_version) {
            /* Copied bytewise: ISO C has no function-to-object pointer cast (like dlsym). */
            _Static_assert(sizeof(generic_fn) == sizeof(void *), "function pointer size");
            memcpy(pfn, &g_procs[i].fn, sizeof(void *));
            if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
            trace("cuGetProcAddress(%s, %d) -> ok", symbol, cudaVersion);
            return CUDA_SUCCESS;
        }
    }
    *pfn = NULL;
    if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    trace("cuGetProcAddress(%s, %d) -> CUDA_ERROR_NOT_FOUND", symbol, cudaVersion);
    return CUDA_ERROR_NOT_FOUND;
}

FAKE_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    (void)flags;
    return lookup_proc(symbol, pfn, cudaVersion, NULL);
}

FAKE_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags, int *symbolStatus) {
    (void)flags;
    return lookup_proc(symbol, pfn, cudaVersion, symbolStatus);
}
