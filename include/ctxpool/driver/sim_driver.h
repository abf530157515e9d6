// ctxpool/driver/sim_driver.h — a simulated GPU behind the Driver seam.
//
// SimDriver is how ctxpool proves its allocators correct without a GPU, and
// how operators plan capacity ("do these six models fit on an 80 GB card?").
// It behaves like the CUDA driver where that matters and is stricter where
// misuse is silent on hardware:
//
//   * Devices with a capacity (presets: "h100-80gb", "a10-24gb", ...), a VMM
//     granularity (2 MiB) and a context overhead charged when a primary
//     context is first retained (and for each cuCtxCreate).
//   * Device addresses are fake: a reserved numeric range with nothing behind
//     it. Pinned host memory is real (malloc'd, page aligned).
//   * Streams are queues with a logical clock. Work on a stream completes at
//     once unless the stream is held: Hold(s) keeps new work pending,
//     Advance(s, n) completes n operations, Release(s) completes everything.
//     Events complete when the work before them completes; StreamWaitEvent
//     makes later work wait for the event; host funcs run (on the calling
//     thread) when they complete.
//   * Misuse returns the error the driver returns (double free, unmapping what
//     is not mapped, a destroyed stream, no current context, ...) AND is
//     counted and logged: tests assert misuse_count() == 0.
//   * A stream-race detector: Touch(stream, ptr, bytes), memsets and copies
//     record accesses; happens-before is tracked with vector clocks (stream
//     order, event waits, host synchronisation); two accesses to overlapping
//     ranges from different streams that are not ordered are reported.
//   * A cost model per call kind (zero unless set) advances a simulated clock,
//     so replays estimate time spent in the driver and its jitter.
//   * Fault injection: fail the next N calls of a kind with a chosen CUresult.
//   * Deterministic: the same calls give the same handles and addresses.
//
// Example:
//
//   auto sim = SimDriver::Create({.devices = {*SimDevicePreset("a10-24gb")}});
//   ContextHandle ctx = *sim->PrimaryCtxRetain(0);
//   sim->CtxSetCurrent(ctx);
//   StreamHandle s = *sim->StreamCreate(kStreamNonBlocking, 0);
//   sim->Hold(s);
//   EventHandle e = *sim->EventCreate(kEventDisableTiming);
//   sim->EventRecord(e, s);
//   *sim->EventQuery(e);   // false: the stream is held
//   sim->Release(s);
//   *sim->EventQuery(e);   // true
//
// Thread-safety: every method is thread-safe (one internal mutex). Host funcs
// run outside the mutex, in completion order, one at a time (like the
// driver's callback thread): on the thread whose call completed their work,
// or on the thread already running host funcs. A host func may call the
// driver. The blocking calls (StreamSynchronize, EventSynchronize,
// CtxSynchronize) on work that a held stream keeps pending do not deadlock:
// they fail with CUDA_ERROR_NOT_READY and count a misuse ("would block
// forever"); call Release first. cuMemFree does not wait for held streams; a
// held access to the freed range is reported as a use after free (a misuse;
// the free itself still succeeds, as on the driver, which would have waited).
//
// Choices where the driver is silent or SimDriver is stricter:
//   * Addresses: one bump pointer per SimDriver, starting at 2^52 (far from
//     host addresses), for cuMemAlloc and cuMemAddressReserve alike; an
//     address is never reused within one SimDriver, so stale pointers are
//     always caught. Handles are counters with a base per kind.
//   * Current context: a per-thread stack per SimDriver. Memory, stream,
//     event and pinned-host calls need a live current context
//     (CUDA_ERROR_INVALID_CONTEXT without one, CUDA_ERROR_CONTEXT_IS_DESTROYED
//     when it was destroyed or its primary context fully released). VMM calls
//     name their device and need none. The last primary release (and
//     cuCtxDestroy) destroys the context's streams and events and frees the
//     cuMemAlloc memory it still owns, as the driver does.
//   * The null stream is the context's legacy default stream: its work waits
//     for all earlier work of the context's blocking streams (created without
//     kStreamNonBlocking), and theirs waits for it.
//   * VMM: cuMemCreate, cuMemAddressReserve and cuMemMap sizes, addresses
//     and offsets must be multiples of the granularity; a map must lie in one
//     reservation and must not overlap a mapping (all CUDA_ERROR_INVALID_VALUE,
//     the error cuMemMap documents; CUDA_ERROR_ALREADY_MAPPED is not used).
//     cuMemUnmap takes a run of whole mappings. cuMemRelease of a mapped
//     handle frees the memory at its last unmap. cuMemAddressFree takes a
//     whole reservation with nothing mapped.
//   * Capacity: cuMemAlloc charges its size rounded up to alloc_alignment;
//     running out is CUDA_ERROR_OUT_OF_MEMORY and never a misuse.
//   * The race detector checks logical order only (stream order, event
//     waits, legacy-stream barriers, host synchronisation), not which work
//     happened to complete first, so a race is found even when holds are not
//     used. The host's clock is shared by all threads.
#ifndef CTXPOOL_DRIVER_SIM_DRIVER_H_
#define CTXPOOL_DRIVER_SIM_DRIVER_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ctxpool/driver/driver.h"

namespace ctxpool {

inline constexpr std::size_t kKiB = std::size_t{1} << 10;
inline constexpr std::size_t kMiB = std::size_t{1} << 20;
inline constexpr std::size_t kGiB = std::size_t{1} << 30;

// The largest capacity a simulated device may have: 16 TiB, about a hundred
// times the largest GPU made. Specs and replays above it are refused (a
// typo such as 4096TiB would otherwise reserve virtual ranges no device
// has).
inline constexpr std::size_t kSimMaxCapacityBytes = std::size_t{16} << 40;

// One simulated device.
struct SimDeviceSpec {
  std::string name = "ctxpool simulated GPU";
  std::size_t capacity_bytes = 80 * kGiB;
  std::size_t vmm_granularity = 2 * kMiB;
  // Device memory charged when a context is created on the device (the
  // first primary-context retain, or each cuCtxCreate).
  std::size_t context_overhead_bytes = 500 * kMiB;
  int compute_capability_major = 9;
  int compute_capability_minor = 0;
  int multiprocessor_count = 132;
  bool vmm_supported = true;
  // Alignment of cuMemAlloc results (the driver aligns to at least 256 B; we
  // use 512 B so allocator rounding never changes alignment).
  std::size_t alloc_alignment = 512;
};

// Presets: "h100-80gb", "h200-141gb", "a100-80gb", "a100-40gb", "a10-24gb",
// "l4-24gb", "t4-16gb", "v100-32gb", "rtx4090-24gb" (case-insensitive). The
// capacity is the nominal size in GiB (80 GiB for "h100-80gb"); names and
// compute capabilities are the real ones. Returns NOT_FOUND with the list of
// names otherwise.
absl::StatusOr<SimDeviceSpec> SimDevicePreset(absl::string_view name);
// The preset names, in a stable order.
std::vector<std::string> SimDevicePresetNames();

// The driver calls the cost model, fault injection and counters know about.
enum class SimCall : int {
  kMemAlloc,
  kMemFree,
  kMemCreate,
  kMemRelease,
  kMemMap,
  kMemUnmap,
  kMemSetAccess,
  kMemAddressReserve,
  kMemAddressFree,
  kMemHostAlloc,
  kMemFreeHost,
  kMemHostRegister,
  kMemHostUnregister,
  kStreamCreate,
  kStreamDestroy,
  kStreamQuery,
  kStreamSynchronize,
  kStreamWaitEvent,
  kLaunchHostFunc,
  kEventCreate,
  kEventDestroy,
  kEventRecord,
  kEventQuery,
  kEventSynchronize,
  kPrimaryCtxRetain,
  kPrimaryCtxRelease,
  kCtxCreate,
  kCtxDestroy,
  kCtxSynchronize,
  kMemsetAsync,
  kMemcpyAsync,
  kCount,  // not a call
};
inline constexpr int kSimCallCount = static_cast<int>(SimCall::kCount);
// "cuMemAlloc", "cuMemFree", ...
absl::string_view SimCallName(SimCall call);

struct SimOptions {
  // At least one device; empty means one "h100-80gb".
  std::vector<SimDeviceSpec> devices;
};

// Two accesses the race detector found unordered.
struct SimRace {
  DevicePtr first_ptr;
  std::size_t first_bytes = 0;
  StreamHandle first_stream;
  DevicePtr second_ptr;
  std::size_t second_bytes = 0;
  StreamHandle second_stream;
  std::string description;  // human readable, names both accesses
};

struct SimCostTable;  // sim_costs.h

class SimDriver final : public Driver {
 public:
  static std::unique_ptr<SimDriver> Create(SimOptions options = {});
  // Parses "sim" (one h100-80gb), "sim:h100-80gb", "sim:2xa10-24gb" or
  // "sim:24GiB" / "sim:2x24GiB" (a custom capacity with default other
  // fields). Capacity units: KiB, MiB, GiB, TiB (powers of 1024) and KB, MB,
  // GB, TB (powers of 1000: "24GB" is 24e9 bytes), case-insensitive. Returns
  // INVALID_ARGUMENT naming the accepted forms otherwise.
  static absl::StatusOr<std::unique_ptr<SimDriver>> CreateFromSpec(
      absl::string_view spec);

  ~SimDriver() override;

  // ---- Stream clock --------------------------------------------------------
  // The four calls below accept destroyed streams (their pending work still
  // completes). The null handle means the current context's legacy stream.
  // An unknown handle counts a misuse and does nothing.
  //
  // Work enqueued on `stream` from now on stays pending until Advance/Release.
  void Hold(StreamHandle stream);
  // Completes up to `ops` pending operations of a held stream (in order; an
  // operation waiting on an incomplete event stops the advance). Returns the
  // number completed.
  std::size_t Advance(StreamHandle stream, std::size_t ops);
  // Un-holds the stream and completes all its pending work (and whatever
  // work on other streams was waiting only for it).
  void Release(StreamHandle stream);
  // Operations enqueued but not complete.
  std::size_t PendingOps(StreamHandle stream) const;

  // ---- Work and the race detector -----------------------------------------
  // A simulated kernel that reads and writes [ptr, ptr + bytes) on `stream`,
  // stream-ordered like any work (pending while the stream is held).
  // REQUIRES: a current context; `stream` live (else INVALID_HANDLE).
  // Fails with CUDA_ERROR_ILLEGAL_ADDRESS (and a misuse) when the range is not
  // wholly inside one cuMemAlloc allocation, inside mappings with access
  // (cuMemSetAccess), or inside pinned host memory. bytes == 0 is a no-op.
  absl::Status Touch(StreamHandle stream, DevicePtr ptr, std::size_t bytes);
  // Races found so far (capped at 1000 stored; race_count() keeps counting).
  std::vector<SimRace> Races() const;
  std::uint64_t race_count() const;
  // Turn the detector off for benchmarks (it is on by default). Clocks are
  // still kept; only the shadow memory is skipped.
  void SetRaceDetection(bool enabled);

  // Makes cuDevicePrimaryCtxSetFlags succeed without applying the flags, as
  // drivers have done under constrained cgroups: PrimaryCtxGetState then
  // reports the old flags. Off by default.
  void SetIgnorePrimaryCtxFlags(bool ignore);

  // ---- Misuse --------------------------------------------------------------
  std::uint64_t misuse_count() const;
  // The last misuses (capped at 1000), each "cuMemFree: CUDA_ERROR_...: why".
  std::vector<std::string> misuse_log() const;

  // ---- Fault injection -----------------------------------------------------
  // The next `count` calls of `call` fail with `cuda_error` (without side
  // effects). A later call replaces the pending count.
  void InjectFault(SimCall call, int count, int cuda_error);

  // ---- Cost model ----------------------------------------------------------
  // Each call of `call` advances the simulated clock by `nanoseconds`. A
  // synchronising call (cuMemFree, cuCtxSynchronize, cuStreamSynchronize)
  // also costs the pending work it waits for (zero unless set with
  // SetWorkCost).
  void SetCost(SimCall call, std::int64_t nanoseconds);
  // Cost of each Touch/memset/copy operation on a stream.
  void SetWorkCost(std::int64_t nanoseconds);
  // The realistic table (RealisticSimCosts in sim_costs.h: cuMemAlloc
  // 10 us + 1 us/MiB, cuMemFree 50 us incl. device sync, cuMemCreate 6 us +
  // 0.75 us/MiB, cuMemMap 2 us, cuMemSetAccess 4 us + 0.25 us/MiB,
  // cuMemUnmap 10 us + 0.25 us/MiB, cuMemHostAlloc ~ 1 ms/GiB, event record
  // 2 us), then, when CTXPOOL_SIM_COSTS names a file, the rows of that JSON
  // cost table over it (a table scripts/gpu-check measured). The error of a
  // file that cannot be read or parsed is returned; the built-in table
  // stays in force then.
  absl::Status UseRealisticCosts();
  // Replaces every cost with `table`'s.
  void SetCostTable(const SimCostTable& table);
  // Simulated nanoseconds spent so far in driver calls (all threads).
  std::int64_t simulated_time_ns() const;
  // Simulated nanoseconds spent by calls made on the calling thread; a replay
  // reads it before and after an allocator call to get that call's cost.
  static std::int64_t thread_simulated_time_ns();
  // True while the calling thread is inside a SimDriver call: tests that
  // fail host allocations to attack the allocator leave the simulator's own
  // alone (a real driver does not allocate through operator new).
  static bool InCall();

  // ---- Counters ------------------------------------------------------------
  std::uint64_t call_count(SimCall call) const;
  // Every kind's count, read at once (index: the SimCall), and their sum.
  std::array<std::uint64_t, kSimCallCount> call_counts() const;
  std::uint64_t total_call_count() const;
  // Physical device memory in use: cuMemAlloc + cuMemCreate + contexts.
  std::size_t used_bytes(int device) const;
  std::size_t peak_used_bytes(int device) const;
  // Pinned host memory now live: cuMemHostAlloc'd plus cuMemHostRegister'ed
  // bytes not yet freed or unregistered.
  std::size_t host_bytes() const;
  // Live primary-context references on `device` (retains − releases), and
  // the number of contexts (primary or not) created so far on it.
  int primary_ctx_refcount(int device) const;
  int contexts_created(int device) const;
  // Memory taken by live contexts on `device`.
  std::size_t context_bytes(int device) const;
  const SimDeviceSpec& device_spec(int device) const;
  // Checks the bookkeeping equations: per device, used == live cuMemAlloc
  // bytes (rounded to alloc_alignment) + cuMemCreate bytes not yet freed +
  // context_bytes; per stream, completed + pending == enqueued. For tests.
  absl::Status CheckInvariants() const;

  // ---- Driver ----------------------------------------------------------
  absl::string_view Kind() const override;
  std::string Describe() const override;
  absl::StatusOr<int> DeviceCount() override;
  absl::StatusOr<std::string> DeviceName(int device) override;
  absl::StatusOr<std::size_t> DeviceTotalMem(int device) override;
  absl::StatusOr<int> DeviceGetAttribute(DeviceAttribute attribute,
                                         int device) override;
  absl::StatusOr<ContextHandle> PrimaryCtxRetain(int device) override;
  absl::Status PrimaryCtxRelease(int device) override;
  absl::Status PrimaryCtxSetFlags(int device, unsigned flags) override;
  absl::StatusOr<PrimaryContextState> PrimaryCtxGetState(int device) override;
  absl::StatusOr<ContextHandle> CtxCreate(int device, unsigned flags) override;
  absl::Status CtxDestroy(ContextHandle ctx) override;
  absl::Status CtxPushCurrent(ContextHandle ctx) override;
  absl::StatusOr<ContextHandle> CtxPopCurrent() override;
  absl::StatusOr<ContextHandle> CtxGetCurrent() override;
  absl::Status CtxSetCurrent(ContextHandle ctx) override;
  absl::StatusOr<int> CtxGetDevice() override;
  absl::Status CtxSynchronize() override;
  absl::StatusOr<std::size_t> CtxGetLimit(ContextLimit limit) override;
  absl::Status CtxSetLimit(ContextLimit limit, std::size_t value) override;
  absl::StatusOr<MemInfo> MemGetInfo() override;
  absl::StatusOr<StreamHandle> StreamCreate(unsigned flags,
                                            int priority) override;
  absl::Status StreamDestroy(StreamHandle stream) override;
  absl::StatusOr<bool> StreamQuery(StreamHandle stream) override;
  absl::Status StreamSynchronize(StreamHandle stream) override;
  absl::StatusOr<StreamPriorityRange> StreamGetPriorityRange() override;
  absl::Status StreamWaitEvent(StreamHandle stream, EventHandle event) override;
  absl::Status LaunchHostFunc(StreamHandle stream, HostFn fn,
                              void* user_data) override;
  absl::StatusOr<EventHandle> EventCreate(unsigned flags) override;
  absl::Status EventDestroy(EventHandle event) override;
  absl::Status EventRecord(EventHandle event, StreamHandle stream) override;
  absl::StatusOr<bool> EventQuery(EventHandle event) override;
  absl::Status EventSynchronize(EventHandle event) override;
  absl::StatusOr<DevicePtr> MemAlloc(std::size_t bytes) override;
  absl::Status MemFree(DevicePtr ptr) override;
  absl::Status MemsetD8Async(DevicePtr dst, unsigned char value,
                             std::size_t bytes, StreamHandle stream) override;
  absl::Status MemcpyAsync(DevicePtr dst, DevicePtr src, std::size_t bytes,
                           StreamHandle stream) override;
  absl::StatusOr<std::size_t> MemGetAllocationGranularity(int device) override;
  absl::StatusOr<DevicePtr> MemAddressReserve(std::size_t bytes,
                                              std::size_t alignment) override;
  absl::Status MemAddressFree(DevicePtr ptr, std::size_t bytes) override;
  absl::StatusOr<PhysicalMemHandle> MemCreate(std::size_t bytes,
                                              int device) override;
  absl::Status MemRelease(PhysicalMemHandle handle) override;
  absl::Status MemMap(DevicePtr ptr, std::size_t bytes, std::size_t offset,
                      PhysicalMemHandle handle) override;
  absl::Status MemUnmap(DevicePtr ptr, std::size_t bytes) override;
  absl::Status MemSetAccess(DevicePtr ptr, std::size_t bytes,
                            int device) override;
  absl::StatusOr<void*> MemHostAlloc(std::size_t bytes,
                                     unsigned flags) override;
  absl::Status MemFreeHost(void* ptr) override;
  absl::Status MemHostRegister(void* ptr, std::size_t bytes,
                               unsigned flags) override;
  absl::Status MemHostUnregister(void* ptr) override;

 private:
  struct State;  // everything, behind one mutex (sim_driver.cc)
  explicit SimDriver(SimOptions options);
  // Runs completed host funcs, in completion order, without the mutex held.
  void RunHostFuncs();
  std::unique_ptr<State> state_;
};

}  // namespace ctxpool

#endif  // CTXPOOL_DRIVER_SIM_DRIVER_H_
