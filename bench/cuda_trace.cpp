// cuda_trace: a kernel timeline of any CUDA program, for the GPU machine where Nsight Systems is not installed.
// Loaded with LD_PRELOAD; CUPTI's activity API records every kernel (graph nodes included) and copy with its
// GPU start and end, and at exit the records are written as CSV to $MERLIN_TRACE (default cuda_trace.csv):
//   kind,start_ns,end_ns,graph_node,name      (kind K = kernel, M = memcpy, S = memset)
// bench/cuda_trace_summary.py turns a trace into per-step kernel times and the gaps between them.
//   LD_PRELOAD=build/lib/libmerlin_cuda_trace.so MERLIN_TRACE=t.csv merlin bench --device cuda ...
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8u << 20;

struct Record {
  char kind;
  unsigned long long start, end;
  unsigned node;
  std::string name;
};

std::mutex g_mu;
std::vector<Record> g_records;
bool g_on = false;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

// Kernel names come mangled; the summary reads them demangled (mv1_kernel<2, 2, 0, true> rather than _ZN...).
std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && d ? d : name;
  std::free(d);
  return out;
}

void keep(const CUpti_Activity* a) {
  Record r{};
  if (a->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || a->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(a);
    r = {'K', k->start, k->end, k->graphNodeId > 0xFFFFFFFFull ? 0u : (unsigned)k->graphNodeId, demangle(k->name)};
  } else if (a->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
    const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(a);
    r = {'M', m->start, m->end, (unsigned)m->graphNodeId, m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "HtoD"
                                                          : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "DtoH"
                                                                                                           : "copy"};
  } else if (a->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
    const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(a);
    r = {'S', m->start, m->end, (unsigned)m->graphNodeId, "memset"};
  } else {
    return;
  }
  const std::lock_guard<std::mutex> lock(g_mu);
  g_records.push_back(std::move(r));
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* a = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &a) == CUPTI_SUCCESS) keep(a);
  std::free(buffer);
}

std::string csv_quoted(const std::string& s) {  // a double quote inside a quoted CSV field is doubled
  std::string out;
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out;
}

void write_trace() {
  if (!g_on) return;
  g_on = false;
  cuptiActivityFlushAll(1);
  if (g_records.empty()) return;  // a process that ran no CUDA work (e.g. `timeout` in front of the program)
  const char* path = std::getenv("MERLIN_TRACE");
  FILE* f = std::fopen(path ? path : "cuda_trace.csv", "w");
  if (!f) return;
  std::fprintf(f, "kind,start_ns,end_ns,graph_node,name\n");
  const std::lock_guard<std::mutex> lock(g_mu);
  for (const Record& r : g_records)
    std::fprintf(f, "%c,%llu,%llu,%u,\"%s\"\n", r.kind, r.start, r.end, r.node, csv_quoted(r.name).c_str());
  std::fclose(f);
  std::fprintf(stderr, "[cuda_trace] %zu records -> %s\n", g_records.size(), path ? path : "cuda_trace.csv");
}

// The runtime may tear the context down before this library's destructor runs: flush when it starts to.
void CUPTIAPI on_callback(void*, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void*) {
  if (domain == CUPTI_CB_DOMAIN_RESOURCE && id == CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING) cuptiActivityFlushAll(1);
}

__attribute__((constructor)) void start_trace() {
  CUpti_SubscriberHandle sub{};
  if (cuptiSubscribe(&sub, on_callback, nullptr) == CUPTI_SUCCESS)
    cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING);
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "[cuda_trace] CUPTI refused activity tracing: no trace\n");
    return;
  }
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  g_on = true;
  std::atexit(write_trace);
}

__attribute__((destructor)) void stop_trace() { write_trace(); }

}  // namespace
