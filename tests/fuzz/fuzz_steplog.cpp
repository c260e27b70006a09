// Step logs: the first byte chooses CSV or JSON Lines, the rest is the log. A log
// that parses is summarized, compared with itself, analysed as a crossover and
// written back; what is written must read back to the same records.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "leanstep/stats.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace leanstep::stats;
  if (size < 1) return 0;
  const bool csv = data[0] & 1;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  return leanstep::fuzz::run_one([&] {
    const auto records = parse_step_log(text, csv ? "fuzz.rank0.csv" : "fuzz.rank0.jsonl", csv);
    if (records.empty()) return;
    const auto summaries = summarize(records, data[0] >> 4, 1 + (data[0] >> 1 & 7));
    (void)summaries_to_json(summaries).dump();
    (void)format_summary_table(summaries);
    // Written back as JSON Lines, the records read back equal.
    std::string written;
    for (const auto& r : records) written += format_step_record_json(r) + "\n";
    const auto again = parse_step_log(written, "fuzz.rank0.jsonl", false);
    if (again.size() != records.size()) std::abort();
    for (size_t i = 0; i < again.size(); ++i)
      if (again[i].rank != records[i].rank || again[i].step != records[i].step || again[i].run != records[i].run ||
          again[i].condition != records[i].condition)
        std::abort();
    if (build_series(records).size() == 1) (void)to_json(compare(records, records, 0, 2)).dump();
    (void)to_json(analyze_crossover(records)).dump();
  });
}
