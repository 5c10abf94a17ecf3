// Torch's OpenMP threads of the calling thread bound one to a CPU each (node_agent/model/cpu_kernels.py),
// as vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND does: thread i of the team the caller leads runs on cpus[i].
// Each thread sets its own affinity from inside one parallel region of one iteration a thread, so
// the team bound is the one the calling thread's forwards use (libgomp keeps a team per thread
// that starts parallel regions).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sched.h>
#include <vector>

// Returns, for each thread of the team, the CPU it runs on after binding (-1 where binding failed).
std::vector<int64_t> bind_threads(c10::IntArrayRef cpus) {
  const int64_t threads = at::get_num_threads();
  TORCH_CHECK(static_cast<int64_t>(cpus.size()) >= threads, "bind_threads: ", threads, " threads, ",
              cpus.size(), " CPUs given");
  std::vector<int64_t> placed(threads, -1);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    const int64_t i = at::get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[i], &set);
    if (sched_setaffinity(0, sizeof(set), &set) == 0) placed[i] = sched_getcpu();
  });
  return placed;
}

// An operator (torch.ops.cortex.bind_threads) beside the attention kernels, in the same library.
TORCH_LIBRARY_FRAGMENT(cortex, m) { m.def("bind_threads(int[] cpus) -> int[]", &bind_threads); }
