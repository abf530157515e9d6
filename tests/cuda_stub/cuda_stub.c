/* A fake libcuda for tests/cuda_driver_test.cc.
 *
 * It exports cuGetProcAddress_v2 only, as the real driver does for ctxpool's
 * purposes, and behaves according to CTXPOOL_STUB_MODE, read at each call:
 *
 *   "stub" (default)  cuInit returns CUDA_ERROR_STUB_LIBRARY (34), like the
 *                     toolkit's lib64/stubs/libcuda.so.
 *   "toolkit"         cuGetProcAddress itself returns CUDA_ERROR_STUB_LIBRARY,
 *                     as the CUDA 13 toolkit's stub does.
 *   "nodevice"        cuInit returns CUDA_ERROR_NO_DEVICE (100).
 *   "ok"              cuInit succeeds, the driver is CUDA 13.0 with two
 *                     devices; a few calls answer (see below), every other
 *                     entry point returns CUDA_ERROR_NOT_SUPPORTED (801).
 *
 * CTXPOOL_STUB_MISSING names one entry point that cuGetProcAddress reports as
 * not found. ctxpool_stub_requested_version(symbol) returns the cudaVersion
 * the last lookup of `symbol` asked for (-1 when never asked), so the test can
 * check the ABI versions CudaDriver requests.
 *
 * Plain C, no cuda.h: the test must build without the toolkit's headers. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;

enum {
  kSuccess = 0,
  kOutOfMemory = 2,
  kStubLibrary = 34,
  kNoDevice = 100,
  kNotReady = 600,
  kNotSupported = 801
};

static const char* Mode(void) {
  const char* mode = getenv("CTXPOOL_STUB_MODE");
  return mode != NULL ? mode : "stub";
}

static CUresult NotSupported(void) {
  return strcmp(Mode(), "ok") == 0 ? kNotSupported : kStubLibrary;
}

static CUresult StubInit(unsigned flags) {
  (void)flags;
  if (strcmp(Mode(), "ok") == 0) return kSuccess;
  if (strcmp(Mode(), "nodevice") == 0) return kNoDevice;
  return kStubLibrary;
}

static CUresult StubDriverGetVersion(int* version) {
  if (strcmp(Mode(), "ok") != 0) return kStubLibrary;
  *version = 13000;
  return kSuccess;
}

static CUresult StubDeviceGet(int* device, int ordinal) {
  if (ordinal < 0 || ordinal >= 2) return 101; /* INVALID_DEVICE */
  *device = ordinal;
  return kSuccess;
}

static CUresult StubDeviceGetCount(int* count) {
  *count = 2;
  return kSuccess;
}

static CUresult StubDeviceGetName(char* name, int len, int device) {
  (void)device;
  strncpy(name, "ctxpool stub GPU", (size_t)len);
  return kSuccess;
}

static CUresult StubDeviceTotalMem(size_t* bytes, int device) {
  *bytes = ((size_t)1 << 30) * (size_t)(device + 1);
  return kSuccess;
}

/* The CUDA 13 ABI of cuCtxGetDevice: (CUdevice*, CUcontext). */
static CUresult StubCtxGetDevice(int* device, void* ctx) {
  *device = ctx == NULL ? 1 : 0;
  return kSuccess;
}

static CUresult StubStreamQuery(void* stream) {
  return stream == NULL ? kSuccess : kNotReady;
}

static CUresult StubEventQuery(void* event) {
  (void)event;
  return kSuccess;
}

static CUresult StubMemAlloc(uint64_t* ptr, size_t bytes) {
  (void)ptr;
  (void)bytes;
  return kOutOfMemory;
}

struct Requested {
  char symbol[64];
  int version;
};
static struct Requested requested[128];
static int requested_count = 0;

int ctxpool_stub_requested_version(const char* symbol) {
  for (int i = 0; i < requested_count; ++i) {
    if (strcmp(requested[i].symbol, symbol) == 0) return requested[i].version;
  }
  return -1;
}

static void Remember(const char* symbol, int version) {
  for (int i = 0; i < requested_count; ++i) {
    if (strcmp(requested[i].symbol, symbol) == 0) {
      requested[i].version = version;
      return;
    }
  }
  if (requested_count < 128) {
    strncpy(requested[requested_count].symbol, symbol, 63);
    requested[requested_count].version = version;
    ++requested_count;
  }
}

CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version,
                             uint64_t flags, int* status) {
  (void)flags;
  Remember(symbol, version);
  if (strcmp(Mode(), "toolkit") == 0) {
    *pfn = NULL;
    return kStubLibrary;
  }
  const char* missing = getenv("CTXPOOL_STUB_MISSING");
  if (missing != NULL && strcmp(missing, symbol) == 0) {
    *pfn = NULL;
    if (status != NULL) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return kSuccess;
  }
  if (status != NULL) *status = 0;
  if (strcmp(symbol, "cuInit") == 0) {
    *pfn = (void*)&StubInit;
  } else if (strcmp(symbol, "cuDriverGetVersion") == 0) {
    *pfn = (void*)&StubDriverGetVersion;
  } else if (strcmp(symbol, "cuDeviceGet") == 0) {
    *pfn = (void*)&StubDeviceGet;
  } else if (strcmp(symbol, "cuDeviceGetCount") == 0) {
    *pfn = (void*)&StubDeviceGetCount;
  } else if (strcmp(symbol, "cuDeviceGetName") == 0) {
    *pfn = (void*)&StubDeviceGetName;
  } else if (strcmp(symbol, "cuDeviceTotalMem") == 0) {
    *pfn = (void*)&StubDeviceTotalMem;
  } else if (strcmp(symbol, "cuCtxGetDevice") == 0) {
    *pfn = (void*)&StubCtxGetDevice;
  } else if (strcmp(symbol, "cuStreamQuery") == 0) {
    *pfn = (void*)&StubStreamQuery;
  } else if (strcmp(symbol, "cuEventQuery") == 0) {
    *pfn = (void*)&StubEventQuery;
  } else if (strcmp(symbol, "cuMemAlloc") == 0) {
    *pfn = (void*)&StubMemAlloc;
  } else {
    /* Every other entry point: called through its own signature, it ignores
     * its arguments (the caller cleans up in every x86-64/aarch64 ABI). */
    *pfn = (void*)&NotSupported;
  }
  return kSuccess;
}
