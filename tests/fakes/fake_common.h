/*
 * fake_common.h - helpers shared by the fake NVIDIA driver libraries used in
 * gpudiag's tests (fake_nvml.c -> libnvidia-ml.so.1, fake_cuda.c -> libcuda.so.1).
 *
 * Everything here is `static inline` so that each library gets its own private
 * copy (and unused helpers draw no warnings); both fakes may be loaded into the
 * same process, so nothing in this header is exported.
 *
 * Steering
 * --------
 * The fakes are steered by FAKE_* environment variables.  If FAKE_GPU_STATE_FILE
 * names a file, its KEY=VALUE lines (blank lines and '#' comments ignored;
 * the last assignment of a key wins) override the environment.  The file is
 * stat()ed on every lookup and re-read whenever its identity, size, mtime or
 * ctime changes (and on every lookup during the two seconds after a change,
 * when coarse timestamps could hide a second write), so a long-running process
 * sees changes while it runs.  A missing state file means "no overrides".
 * Writers should replace the file atomically (write a temporary, rename).
 *
 * Per-device list knobs use `IDX:VALUE[,IDX:VALUE...]`; an index may address a
 * MIG instance as `IDX.J`.
 *
 * Device identity (shared with the fake nvidia-smi, which reads it via NVML):
 *   GPU i:          UUID GPU-f00d%04x-0000-4000-8000-00000000%04x (i, i)
 *   MIG j of GPU i: UUID MIG-f00d%04x-%04x-4000-8000-000000000000 (i, j)
 *   PCI bus id 00000000:%02X:00.0 with bus 0x18 + i, name FAKE_GPU_NAME
 *   (default "NVIDIA H200"), FAKE_GPU_MEMORY_TOTAL_MIB (default 143771).
 *
 * Occupancy (shared with the fake CUDA driver, which refuses contexts the way
 * the real one would on a GPU in this state):
 *   FAKE_NVML_COMPUTE_MODE=IDX:N   per physical GPU: 0 DEFAULT, 1 EXCLUSIVE_THREAD,
 *                                  2 PROHIBITED, 3 EXCLUSIVE_PROCESS
 *   FAKE_NVML_PROCESSES=IDX[.J]:PID:USED_MIB,...   running compute processes
 *   FAKE_NVML_MEMORY_USED_MIB=IDX[.J]:MIB          used memory of a GPU or MIG instance
 * The processes' USED_MIB is what NVML reports per process; it is not added to
 * FAKE_NVML_MEMORY_USED_MIB (set both, as tests/fakes/jobs.py does).
 */
#ifndef GPUDIAG_FAKE_COMMON_H
#define GPUDIAG_FAKE_COMMON_H

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* Only the driver API is exported from the fakes (built -fvisibility=hidden). */
#define FAKE_EXPORT __attribute__((visibility("default")))

#define FAKE_MAX_GPUS 64  /* a 64-GPU host for the daemon benchmark (benchmarks/daemon.py --gpus) */
#define FAKE_MAX_MIG 7
#define FAKE_DEFAULT_GPU_COUNT 8
#define FAKE_DEFAULT_MEMORY_MIB 143771ULL
#define FAKE_DEFAULT_NAME "NVIDIA H200"
#define FAKE_DEFAULT_DRIVER_VERSION "570.124.06"
#define FAKE_DEFAULT_CUDA_VERSION 12080
#define FAKE_MIB (1024ULL * 1024ULL)

/* ------------------------------------------------------------------------- */
/* State file cache                                                          */
/* ------------------------------------------------------------------------- */

/* Largest state file honoured; anything beyond is ignored. */
#define FAKE_STATE_MAX_BYTES (1 << 20)

typedef struct {
    pthread_mutex_t lock;
    int loaded;            /* a state file is currently cached */
    char path[4096];       /* path the cache belongs to */
    dev_t dev;             /* identity of the cached file ... */
    ino_t ino;
    off_t size;
    struct timespec mtime; /* ... and its modification time */
    struct timespec ctime;
    char *text;            /* file text, lines split in place into key/values */
    size_t nentries;
    char **keys;
    char **values;
} fake_state_t;

/* One instance per library (the header is included by exactly one .c each). */
static fake_state_t fake_state = {.lock = PTHREAD_MUTEX_INITIALIZER};

static inline char *fake_strip(char *s) {
    while (*s && isspace((unsigned char)*s)) s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
    return s;
}

static inline void fake_state_clear_locked(void) {
    free(fake_state.text);
    free(fake_state.keys);
    free(fake_state.values);
    fake_state.text = NULL;
    fake_state.keys = NULL;
    fake_state.values = NULL;
    fake_state.nentries = 0;
    fake_state.loaded = 0;
}

/* Parses `text` (owned by the cache afterwards) into KEY=VALUE entries. */
static inline void fake_state_parse_locked(char *text) {
    size_t cap = 16;
    char **keys = malloc(cap * sizeof *keys);
    char **values = malloc(cap * sizeof *values);
    size_t n = 0;
    char *save = NULL;
    if (!keys || !values) {
        free(keys);
        free(values);
        free(text);
        return;
    }
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *s = fake_strip(line);
        if (*s == '\0' || *s == '#') continue;
        char *eq = strchr(s, '=');
        if (!eq) continue;
        *eq = '\0';
        char *k = fake_strip(s);
        char *v = fake_strip(eq + 1);
        if (*k == '\0') continue;
        if (n == cap) {
            cap *= 2;
            char **nk = realloc(keys, cap * sizeof *keys);
            if (!nk) break;
            keys = nk;
            char **nv = realloc(values, cap * sizeof *values);
            if (!nv) break;
            values = nv;
        }
        keys[n] = k;
        values[n] = v;
        n++;
    }
    fake_state.text = text;
    fake_state.keys = keys;
    fake_state.values = values;
    fake_state.nentries = n;
    fake_state.loaded = 1;
}

/* Re-reads the state file if it changed since the last look.  Lock held. */
static inline void fake_state_refresh_locked(void) {
    const char *path = getenv("FAKE_GPU_STATE_FILE");
    struct stat st;
    if (!path || !*path || stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
        fake_state_clear_locked();
        return;
    }
    /*
     * File timestamps are only as fine as the kernel's coarse clock (a few
     * ms), so two same-size writes in quick succession can leave stat()
     * unchanged.  While the file was modified within the last two seconds the
     * cache counts as "racy" and is re-read on every lookup (as git does).
     */
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    int racy = now.tv_sec - st.st_mtim.tv_sec < 2;
    if (!racy && fake_state.loaded && strcmp(fake_state.path, path) == 0 &&
        fake_state.dev == st.st_dev && fake_state.ino == st.st_ino &&
        fake_state.size == st.st_size && fake_state.mtime.tv_sec == st.st_mtim.tv_sec &&
        fake_state.mtime.tv_nsec == st.st_mtim.tv_nsec &&
        fake_state.ctime.tv_sec == st.st_ctim.tv_sec &&
        fake_state.ctime.tv_nsec == st.st_ctim.tv_nsec) {
        return;
    }
    fake_state_clear_locked();
    FILE *f = fopen(path, "r");
    if (!f) return;
    size_t cap = (size_t)(st.st_size > 0 ? st.st_size : 0) + 1;
    if (cap > FAKE_STATE_MAX_BYTES) cap = FAKE_STATE_MAX_BYTES;
    char *text = malloc(cap + 1);
    if (!text) {
        fclose(f);
        return;
    }
    size_t got = fread(text, 1, cap, f);
    fclose(f);
    text[got] = '\0';
    snprintf(fake_state.path, sizeof fake_state.path, "%s", path);
    fake_state.dev = st.st_dev;
    fake_state.ino = st.st_ino;
    fake_state.size = st.st_size;
    fake_state.mtime = st.st_mtim;
    fake_state.ctime = st.st_ctim;
    fake_state_parse_locked(text);
}

/*
 * Returns a malloc'd copy of the knob KEY (state file first, then the
 * environment), or NULL when it is set nowhere.  The caller frees it.
 */
static inline char *fake_get_dup(const char *key) {
    char *out = NULL;
    int found = 0;
    pthread_mutex_lock(&fake_state.lock);
    fake_state_refresh_locked();
    /* The last assignment in the file wins, like a shell script. */
    for (size_t i = fake_state.nentries; i > 0; i--) {
        if (strcmp(fake_state.keys[i - 1], key) == 0) {
            out = strdup(fake_state.values[i - 1]);
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&fake_state.lock);
    if (!found) {
        const char *env = getenv(key);
        if (env) out = strdup(env);
    }
    return out;
}

/* Parses a decimal or 0x-prefixed hexadecimal integer; returns 1 on success. */
static inline int fake_parse_ll(const char *s, long long *out) {
    if (!s) return 0;
    while (*s && isspace((unsigned char)*s)) s++;
    if (!*s) return 0;
    int base = 10;
    const char *p = s;
    int neg = 0;
    if (*p == '-' || *p == '+') {
        neg = *p == '-';
        p++;
    }
    if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X')) {
        base = 16;
        p += 2;
    }
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(p, &end, base);
    if (end == p || errno != 0) return 0;
    while (*end && isspace((unsigned char)*end)) end++;
    if (*end) return 0;
    *out = neg ? -(long long)v : (long long)v;
    return 1;
}

/* Integer knob with a default (also used when the value does not parse). */
static inline long long fake_get_ll(const char *key, long long def) {
    char *v = fake_get_dup(key);
    long long out = def;
    if (v && !fake_parse_ll(v, &out)) out = def;
    free(v);
    return out;
}

/* True when a knob is set to a non-empty value other than "0". */
static inline int fake_get_flag(const char *key) {
    char *v = fake_get_dup(key);
    int on = v && *fake_strip(v) && strcmp(fake_strip(v), "0") != 0;
    free(v);
    return on;
}

/* String knob copied into buf (truncated), default when unset or empty. */
static inline void fake_get_str(const char *key, const char *def, char *buf, size_t len) {
    char *v = fake_get_dup(key);
    const char *src = (v && *fake_strip(v)) ? fake_strip(v) : def;
    snprintf(buf, len, "%s", src);
    free(v);
}

/*
 * Parses a list key "IDX" or "IDX.J" into (idx, sub); sub is -1 without ".J".
 */
static inline int fake_parse_index(const char *s, int *idx, int *sub) {
    char buf[32];
    snprintf(buf, sizeof buf, "%s", s);
    char *t = fake_strip(buf);
    char *dot = strchr(t, '.');
    long long a, b = -1;
    if (dot) {
        *dot = '\0';
        if (!fake_parse_ll(dot + 1, &b) || b < 0) return 0;
    }
    if (!fake_parse_ll(t, &a) || a < 0) return 0;
    *idx = (int)a;
    *sub = (int)b;
    return 1;
}

/*
 * Iterates a per-device list knob.  `cursor` starts as the knob's value (a
 * writable copy); each call returns the next entry split into its index and
 * the text after the first ':' (which may itself contain ':'), or 0 at the end.
 */
static inline int fake_list_next(char **cursor, int *idx, int *sub, char **rest) {
    while (*cursor && **cursor) {
        char *entry = *cursor;
        char *comma = strchr(entry, ',');
        if (comma) {
            *comma = '\0';
            *cursor = comma + 1;
        } else {
            *cursor = entry + strlen(entry);
        }
        char *colon = strchr(entry, ':');
        if (!colon) continue;
        *colon = '\0';
        if (!fake_parse_index(entry, idx, sub)) continue;
        *rest = fake_strip(colon + 1);
        return 1;
    }
    return 0;
}

/*
 * Looks up the entry for (idx, sub) in list knob KEY and parses its value as
 * an integer; returns def when absent or unparsable.  Later entries win.
 */
static inline long long fake_list_ll(const char *key, int idx, int sub, long long def) {
    char *v = fake_get_dup(key);
    long long out = def;
    char *cur = v, *rest;
    int i, j;
    while (fake_list_next(&cur, &i, &j, &rest)) {
        long long parsed;
        if (i == idx && j == sub && fake_parse_ll(rest, &parsed)) out = parsed;
    }
    free(v);
    return out;
}

/*
 * Like fake_list_ll but copies the raw value into buf; returns 1 if found.
 */
static inline int fake_list_str(const char *key, int idx, int sub, char *buf, size_t len) {
    char *v = fake_get_dup(key);
    char *cur = v, *rest;
    int i, j, found = 0;
    while (fake_list_next(&cur, &i, &j, &rest)) {
        if (i == idx && j == sub) {
            snprintf(buf, len, "%s", rest);
            found = 1;
        }
    }
    free(v);
    return found;
}

/* ------------------------------------------------------------------------- */
/* Device identity shared by the fakes                                       */
/* ------------------------------------------------------------------------- */

static inline unsigned long long fake_gpu_memory_total_mib(void) {
    long long v = fake_get_ll("FAKE_GPU_MEMORY_TOTAL_MIB", (long long)FAKE_DEFAULT_MEMORY_MIB);
    return v > 0 ? (unsigned long long)v : FAKE_DEFAULT_MEMORY_MIB;
}

/* Number of MIG instances on GPU i (FAKE_NVML_MIG), 0 when MIG is off. */
static inline int fake_mig_count(int gpu) {
    long long n = fake_list_ll("FAKE_NVML_MIG", gpu, -1, 0);
    if (n < 0) n = 0;
    if (n > FAKE_MAX_MIG) n = FAKE_MAX_MIG;
    return (int)n;
}

/* Memory of one MIG instance: the parent's total split evenly. */
static inline unsigned long long fake_mig_memory_total_mib(int gpu) {
    int n = fake_mig_count(gpu);
    return n > 0 ? fake_gpu_memory_total_mib() / (unsigned long long)n : 0;
}

static inline void fake_gpu_name(char *buf, size_t len) {
    fake_get_str("FAKE_GPU_NAME", FAKE_DEFAULT_NAME, buf, len);
}

/* "NVIDIA H200 MIG 1g.20gb": slices = 7 / count, memory rounded to GB. */
static inline void fake_mig_name(int gpu, char *buf, size_t len) {
    char parent[96];
    int n = fake_mig_count(gpu);
    int slices = n > 0 ? FAKE_MAX_MIG / n : 1;
    if (slices < 1) slices = 1;
    unsigned long long gb = (fake_mig_memory_total_mib(gpu) + 512) / 1024;
    fake_gpu_name(parent, sizeof parent);
    snprintf(buf, len, "%s MIG %dg.%llugb", parent, slices, gb);
}

static inline void fake_gpu_uuid_bytes(int gpu, unsigned char out[16]) {
    static const unsigned char tmpl[16] = {0xf0, 0x0d, 0, 0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0};
    memcpy(out, tmpl, 16);
    out[2] = out[14] = (unsigned char)((gpu >> 8) & 0xff);
    out[3] = out[15] = (unsigned char)(gpu & 0xff);
}

static inline void fake_mig_uuid_bytes(int gpu, int mig, unsigned char out[16]) {
    static const unsigned char tmpl[16] = {0xf0, 0x0d, 0, 0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0};
    memcpy(out, tmpl, 16);
    out[2] = (unsigned char)((gpu >> 8) & 0xff);
    out[3] = (unsigned char)(gpu & 0xff);
    out[4] = (unsigned char)((mig >> 8) & 0xff);
    out[5] = (unsigned char)(mig & 0xff);
}

static inline void fake_gpu_uuid(int gpu, char *buf, size_t len) {
    snprintf(buf, len, "GPU-f00d%04x-0000-4000-8000-00000000%04x", (unsigned)gpu, (unsigned)gpu);
}

static inline void fake_mig_uuid(int gpu, int mig, char *buf, size_t len) {
    snprintf(buf, len, "MIG-f00d%04x-%04x-4000-8000-000000000000", (unsigned)gpu, (unsigned)mig);
}

static inline int fake_pci_bus(int gpu) { return 0x18 + gpu; }

/* ------------------------------------------------------------------------- */
/* Occupancy shared by the fakes                                             */
/* ------------------------------------------------------------------------- */

#define FAKE_COMPUTE_MODE_DEFAULT 0
#define FAKE_COMPUTE_MODE_EXCLUSIVE_THREAD 1
#define FAKE_COMPUTE_MODE_PROHIBITED 2
#define FAKE_COMPUTE_MODE_EXCLUSIVE_PROCESS 3

/* Compute mode of physical GPU i (FAKE_NVML_COMPUTE_MODE), DEFAULT when unset. */
static inline long long fake_compute_mode(int gpu) {
    return fake_list_ll("FAKE_NVML_COMPUTE_MODE", gpu, -1, FAKE_COMPUTE_MODE_DEFAULT);
}

/*
 * True when FAKE_NVML_PROCESSES lists a process other than `self_pid` on the
 * device: for a whole GPU (mig < 0) any process on it or on its MIG instances,
 * for a MIG instance only the processes on that instance (as NVML reports them).
 */
static inline int fake_foreign_process_on(int gpu, int mig, long long self_pid) {
    char *v = fake_get_dup("FAKE_NVML_PROCESSES");
    char *cur = v, *rest;
    int i, j, found = 0;
    while (!found && fake_list_next(&cur, &i, &j, &rest)) {
        if (i != gpu || (mig >= 0 && j != mig)) continue;
        char *colon = strchr(rest, ':');
        if (colon) *colon = '\0';
        long long pid;
        if (fake_parse_ll(rest, &pid) && pid != self_pid) found = 1;
    }
    free(v);
    return found;
}

/* ------------------------------------------------------------------------- */
/* JSON lines logs                                                           */
/* ------------------------------------------------------------------------- */

/* One log line; longer input is cut so that a line always stays whole JSON. */
#define FAKE_LINE_MAX 4096
#define FAKE_JSON_STRING_MAX 512 /* escaped at most 6x: fits in the line */

typedef struct {
    char text[FAKE_LINE_MAX];
    size_t len;
} fake_line_t;

static inline void fake_line_add(fake_line_t *line, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static inline void fake_line_add(fake_line_t *line, const char *fmt, ...) {
    if (line->len >= sizeof line->text) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line->text + line->len, sizeof line->text - line->len, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    line->len += (size_t)n;
    if (line->len >= sizeof line->text) line->len = sizeof line->text - 1;
}

/*
 * Appends `s` as a JSON string (null for NULL), at most FAKE_JSON_STRING_MAX
 * input bytes.  Bytes outside printable ASCII are written as \u00XX, so the
 * line is valid JSON whatever the environment holds.
 */
static inline void fake_line_add_json_string(fake_line_t *line, const char *s) {
    if (!s) {
        fake_line_add(line, "null");
        return;
    }
    fake_line_add(line, "\"");
    for (size_t k = 0; s[k] && k < FAKE_JSON_STRING_MAX; k++) {
        unsigned char c = (unsigned char)s[k];
        if (c == '"' || c == '\\')
            fake_line_add(line, "\\%c", c);
        else if (c < 0x20 || c >= 0x7f)
            fake_line_add(line, "\\u%04x", c);
        else
            fake_line_add(line, "%c", c);
    }
    fake_line_add(line, "\"");
}

/*
 * Appends the line (and a newline) to `path` in one write() on an O_APPEND
 * descriptor, so that lines from concurrent processes never interleave.
 * Returns 0 on success, -1 (errno set) on failure.
 */
static inline int fake_append_line(const char *path, fake_line_t *line) {
    if (line->len + 1 >= sizeof line->text) line->len = sizeof line->text - 2;
    line->text[line->len++] = '\n';
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return -1;
    ssize_t n = write(fd, line->text, line->len);
    int saved = errno;
    close(fd);
    errno = saved;
    return n == (ssize_t)line->len ? 0 : -1;
}

/* ------------------------------------------------------------------------- */
/* Misc                                                                      */
/* ------------------------------------------------------------------------- */

static inline void fake_sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static inline long long fake_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

static inline long long fake_monotonic_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* Never returns: used by the *_HANG knobs. */
static inline void fake_hang_forever(void) {
    for (;;) fake_sleep_ms(3600L * 1000L);
}

#endif /* GPUDIAG_FAKE_COMMON_H */
